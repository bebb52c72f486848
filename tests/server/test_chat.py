"""The chat handler's guard against role injection (`chat.special_token_texts`)."""
from tokenizers import AddedToken

from hybrid_engine.server.chat import special_token_texts
from hybrid_engine.tokenizer import build_byte_tokenizer


def test_unnamed_special_tokens_are_guarded():
    """An added token marked special but named nowhere (as Llama 3's <|start_header_id|>) is
    among the texts that markup fields may not hold: written by the template as markup, its
    text would become the token itself."""
    tokenizer = build_byte_tokenizer()
    header = "<|start_header_id|>"
    tokenizer.add_tokens([AddedToken(header, special=True)])
    assert header not in tokenizer.all_special_tokens  # (what the guard used to check alone)
    assert len(tokenizer.encode(header, add_special_tokens=False)) == 1  # markup: the token
    assert len(tokenizer.encode(header, add_special_tokens=False, split_special_tokens=True)) > 1  # plain text
    texts = special_token_texts(tokenizer)
    assert header in texts and set(tokenizer.all_special_tokens) <= set(texts)
    tokenizer.add_tokens([AddedToken("<plain>", special=False)])
    assert "<plain>" not in special_token_texts(tokenizer)  # (the same tokens as plain text or markup)
