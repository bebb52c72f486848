"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `LLM(...).chat(messages)`."""
import functools
import re
import threading
import time
from typing import Any, Sequence

from tqdm import tqdm

from hybrid_engine.chat_template import load_chat_template, render_chat
from hybrid_engine.config import EngineConfig
from hybrid_engine.engine import LLMEngine
from hybrid_engine.request import RequestOutput
from hybrid_engine.sampling_params import ParameterError, SamplingParams, is_integral
from hybrid_engine.tokenizer import special_token_pattern

Prompt = str | list[int]


class LLM:
    """Load a hybrid model once, then generate for batches of prompts.

    `model=None` is the embedded tiny model, `"preset:NAME"` a published config with
    random weights, anything else a HF checkpoint directory. The keyword arguments are
    `EngineConfig`'s; `llm.engine` is the underlying `LLMEngine`. With
    `tensor_parallel_size=N` the model is sharded over N processes that the `LLM` starts
    itself (docs/parallel.md); `shutdown()` stops them. One `generate` runs at a time: a
    call from another thread meanwhile raises RuntimeError (for concurrent callers, serve
    the model: scripts/serve_hybrid.py).
    """

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self._next_id = 0
        self._generating = threading.Lock()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (`tensor_parallel_size` > 1) and free
        the process group, so another tensor-parallel `LLM` can be built in this process.
        Idempotent; also done when the `LLM` is garbage-collected."""
        self.engine.shutdown()

    def get_tokenizer(self):
        """The model's tokenizer, or None for checkpoints without tokenizer files."""
        return self.engine.tokenizer

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of OpenAI-style message dicts) or several (a
        list of them), as vLLM's `LLM.chat`: each is rendered with the tokenizer's chat
        template (`hybrid_engine.chat_template.render_chat`, as the server renders chat: the
        template reads the real contents, e.g. a "/no_think" switch, but they never yield
        special tokens, so "<|im_end|>" in one stays those characters),
        then generated as `generate` does; outputs come back in conversation order.
        `add_generation_prompt` ends the prompt with the assistant prefix;
        `continue_final_message` (with it false) leaves the last message (usually an
        assistant's) open for the model to continue; `chat_template_kwargs` are extra template variables,
        e.g. {"enable_thinking": False}; `chat_template` is a Jinja template to use instead
        of the tokenizer's, or the path of a file holding one (as the server's
        `--chat-template`). Invalid input raises ValueError naming the field."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ParameterError("messages", "messages: this model has no tokenizer (and so no chat template); "
                                             "generate from token ids instead")
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
            conversations = list(messages)
        else:
            raise ParameterError("messages", "messages must be a list of message dicts, or a list of such lists")
        if chat_template is not None:
            chat_template = load_chat_template(chat_template)
        prompts = [render_chat(tokenizer, list(conversation), self._special_tokens,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs,
                               chat_template=chat_template)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @functools.cached_property
    def _special_tokens(self) -> re.Pattern[str]:
        return special_token_pattern(self.engine.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        `sampling_params`: one SamplingParams (or dict of its fields) for every prompt, or
        one per prompt. Invalid input raises ValueError before anything is queued.
        `generate` steps the engine until its prompts finish, so it needs the engine to
        itself: with requests added through `llm.engine` still unfinished, or another
        thread's `generate` running, it raises RuntimeError (their outputs would otherwise
        be consumed here). Interrupted (Ctrl-C) or failed, it aborts its own requests before
        the exception goes on, so the next call finds the engine free.
        """
        if not self._generating.acquire(blocking=False):
            raise RuntimeError("generate() is already running in another thread: an LLM serves one caller at a "
                               "time (use one LLM per thread, or serve the model for concurrent clients)")
        try:
            return self._generate(prompts, sampling_params, use_tqdm)
        finally:
            self._generating.release()

    def _generate(self, prompts: Prompt | Sequence[Prompt],
                  sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        """`generate`'s work, under its lock."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("generate() needs the engine to itself: it has unfinished requests (added through "
                               "llm.engine); step or abort them first")
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_integral(prompts[0])):
            prompts = [prompts]  # one prompt: a text or its token ids (a list, or a tuple as inside a list)
        if isinstance(prompts, (dict, bytes)) or not hasattr(prompts, "__iter__"):
            # (A dict would be iterated as its keys: vLLM's {"prompt": ...} must not become the prompt "prompt".)
            raise ValueError(f"prompts must be a text, a list of token ids, or a list of those; got "
                             f"{type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(sampling_params, (str, bytes)) or not (
                sampling_params is None or isinstance(sampling_params, (SamplingParams, dict))
                or hasattr(sampling_params, "__iter__")):
            raise ValueError(f"sampling_params must be SamplingParams, a dict of its fields, or a list of those; "
                             f"got {type(sampling_params).__name__}")
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        ids = [f"generate-{self._next_id + i}" for i in range(len(prompts))]
        # All or nothing: if any prompt is invalid, nothing is queued (and no step runs).
        self.engine.add_requests(list(zip(ids, prompts, params_list)))
        self._next_id += len(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        start, generated = time.perf_counter(), 0
        try:
            with bar:
                while len(finished) < len(ids):
                    for out in self.engine.step():
                        generated += len(out.new_token_ids)
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
                    bar.set_postfix(output_tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        except BaseException:
            # Interrupted (Ctrl-C) or failed: this call's requests leave the engine, their
            # resources with them, so that the LLM takes the next call.
            for request_id in ids:
                self.engine.abort_request(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [finished[i] for i in ids]
