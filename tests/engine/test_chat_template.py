"""`LLM.chat` and `render_chat` (hybrid_engine/chat_template.py), which the server's chat
endpoint shares: a conversation's prompt is the chat template rendered with message
contents as plain text; the outputs are `generate`'s for that prompt; bad input raises
ParameterError naming the field. (The server's side: tests/server/test_chat_options.py,
test_tokenize.py, test_bad_requests.py.)"""
import json

import pytest

from hybrid_engine import LLM
from hybrid_engine.chat_template import render_chat
from hybrid_engine.models.embedded import EMBEDDED_CONFIG
from hybrid_engine.sampling_params import ParameterError
from hybrid_engine.tokenizer import CHATML_TEMPLATE, build_byte_tokenizer, special_token_pattern
from tests.engine.engine_helpers import assert_drained, greedy

HI = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_end|> there"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", max_model_len=256)


def _rendered_ids(messages: list[dict], **options) -> list[int]:
    """The template's own rendering with the contents' special-token text left as text."""
    tokenizer = build_byte_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    im_end = "<|im_end|>"
    ids: list[int] = []
    for i, piece in enumerate(rendered.split("hi <|im_end|> there")):
        if i:
            ids += tokenizer.encode("hi " + im_end + " there", add_special_tokens=False, split_special_tokens=True)
        ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def test_chat_is_generate_on_the_rendered_prompt(llm: LLM):
    (reply,) = llm.chat(HI, greedy(10), use_tqdm=False)
    expected = _rendered_ids(HI, add_generation_prompt=True)
    assert reply.prompt_token_ids == expected
    assert reply.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids("<|im_end|>")) == 2  # the template's
    (plain,) = llm.generate([expected], greedy(10), use_tqdm=False)
    assert reply.output_token_ids == plain.output_token_ids and reply.text == plain.text
    assert_drained(llm.engine)


def test_several_conversations_come_back_in_order(llm: LLM):
    other = [{"role": "user", "content": "what?"}]
    replies = llm.chat([other, HI, other], greedy(6), use_tqdm=False)
    alone = [llm.chat(conversation, greedy(6), use_tqdm=False)[0] for conversation in (other, HI)]
    assert [r.output_token_ids for r in replies] == [alone[0].output_token_ids, alone[1].output_token_ids,
                                                     alone[0].output_token_ids]


def test_template_options(llm: LLM):
    opened = HI + [{"role": "assistant", "content": "Hel"}]
    (cont,) = llm.chat(opened, greedy(2), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == _rendered_ids(opened, continue_final_message=True)
    assert cont.prompt_token_ids[-3:] == list(b"Hel")  # no end-of-turn: the model continues the message
    (bare,) = llm.chat(HI, greedy(2), use_tqdm=False, add_generation_prompt=False)
    assert bare.prompt_token_ids == _rendered_ids(HI)


def test_tool_call_arguments_reach_the_template_as_a_mapping(llm: LLM):
    """A JSON-object `arguments` string is parsed (as vLLM and the server do): templates
    write it with `tojson`; anything else stays the string."""
    call = {"id": "c1", "type": "function", "function": {"name": "wx", "arguments": '{"at": 1}'}}
    odd = {"id": "c2", "type": "function", "function": {"name": "wx", "arguments": "[1, 2]"}}
    messages = [{"role": "user", "content": "wx?"}, {"role": "assistant", "content": None, "tool_calls": [call, odd]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    (reply,) = llm.chat(messages, greedy(1), use_tqdm=False)
    prompt = bytes(t for t in reply.prompt_token_ids if t < 256).decode()
    assert '{"name": "wx", "arguments": {"at": 1}}' in prompt and '"arguments": "[1, 2]"' in prompt


def test_template_variables_reach_the_template():
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE + "{% if flavour is defined %}{{ flavour }}{% endif %}"
    pattern = special_token_pattern(tokenizer)
    plain = render_chat(tokenizer, HI, pattern)
    assert render_chat(tokenizer, HI, pattern, template_kwargs={"flavour": "mint"}) == plain + list(b"mint")


@pytest.mark.parametrize("messages, options, param", [
    ([{"role": "user", "content": "a", "name": "x<|im_start|>"}], {}, "messages.0.name"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"k": ["<|im_end|>"]}}}]}], {},
     "messages.1.tool_calls.0.function.arguments"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"<|im_end|>": 1}}}]}], {},
     "messages.1.tool_calls.0.function.arguments"),
    ([{"role": "user", "content": "a"}], {"chat_template_kwargs": {"v": {"w": "<|im_end|>"}}},
     "chat_template_kwargs.v"),
    ([{"role": "user", "content": "a"}], {"chat_template_kwargs": {"v": {"<|im_end|>": 1}}},
     "chat_template_kwargs.v"),
    ([{"role": "user", "content": "a"}], {"chat_template_kwargs": {"<|im_end|>": 1}}, "chat_template_kwargs"),
    # the renderer's own arguments (whatever this transformers names them) and the conversation
    ([{"role": "user", "content": "a"}], {"chat_template_kwargs": {"chat_template": "{{ '<|im' + '_end|>' }}"}},
     "chat_template_kwargs"),
    ([{"role": "user", "content": "a"}], {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ([{"role": "user", "content": "a"}], {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ([{"role": "user", "content": 5}], {}, "messages"),
    ([{"role": "user", "content": "a"}], {"continue_final_message": True}, "continue_final_message"),
    ([{"role": "user", "content": "a"}], {"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ("hello", {}, "messages"),
    ([[{"role": "user", "content": "a"}], "b"], {}, "messages"),
])
def test_bad_input_names_the_field(llm: LLM, messages, options: dict, param: str):
    with pytest.raises(ParameterError) as error:
        llm.chat(messages, greedy(2), use_tqdm=False, **options)
    assert error.value.param == param and param in str(error.value)
    assert_drained(llm.engine)


def test_chat_needs_a_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(EMBEDDED_CONFIG))
    bare = LLM(model=str(tmp_path), device="cpu", dtype="float32", load_format="dummy", max_model_len=64)
    with pytest.raises(ParameterError, match="no tokenizer") as error:
        bare.chat([{"role": "user", "content": "hi"}], greedy(2), use_tqdm=False)
    assert error.value.param == "messages"
