"""scripts/bench_structured.py on a small synthetic vocabulary and on a real tokenizer."""
import sys
from pathlib import Path

import pytest

from hybrid_engine.tokenizer import build_byte_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_structured  # noqa: E402


def test_synthetic_tokenizer_encodes_text_back_exactly():
    tokenizer = bench_structured.SyntheticTokenizer(3000)
    for _, text in bench_structured.GRAMMARS.values():
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.pieces[i] for i in ids) == text.encode()
        assert len(ids) < len(text.encode())  # (longer pieces are used where they fit)


@pytest.mark.parametrize("tokenizer_dir", [False, True])
def test_every_grammar_gets_its_row(tmp_path, monkeypatch, capsys, tokenizer_dir):
    argv = ["bench_structured.py", "--vocab-size", "3000", "--repeats", "1"]
    if tokenizer_dir:
        build_byte_tokenizer().save_pretrained(tmp_path)
        argv += ["--tokenizer", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_structured.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == list(bench_structured.GRAMMARS)
    for row in rows[1:]:
        tokens, *times = row.strip("| ").split(" | ")[1:]
        assert int(tokens) > 0 and all(float(t.split()[0]) >= 0 for t in times)
