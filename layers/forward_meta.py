"""What one forward step tells the layers about the packed batch.

Row layout (fixed by the step buffer layout in `cache/step_buffer.py`): the first
`num_decode` sequences are decode rows of `decode_width` tokens each (one, or a verify
row's input token, drafts and padding: tokens [0, num_decode * decode_width)); the
`num_prefill` prefill chunks follow, packed. Python ints here are
the step's *shape* (they select kernels and sizes); every value the kernels read lives in
the device tensors, mirrored from the CPU bookkeeping buffer by one copy per step.
"""
from dataclasses import dataclass

import torch

from layers.kernels.ops import StateSaves


@dataclass
class ForwardMeta:
    """Device views of the step's metadata plus the host-known shape of the step."""

    num_decode: int  # decode sequences (= decode tokens), first in the batch
    num_prefill: int  # prefill-chunk sequences after them
    num_tokens: int  # all tokens of the step (padded rows included)
    max_seqlen_q: int  # longest query chunk this step
    positions: torch.Tensor  # [T] int64 absolute position of each token
    prompt_token_mask: torch.Tensor  # [T] bool: token is part of the prompt (Mamba dt limit applies)
    slot_mapping: torch.Tensor  # [T] int64 KV cache slot of each token, -1 = don't write
    cu_seqlens_q: torch.Tensor  # [S+1] int32 query starts of every sequence
    prefill_cu_seqlens: torch.Tensor  # [P+1] int32 query starts of the prefill chunks, from 0
    seq_lens: torch.Tensor  # [S] int32 keys per sequence after this step (0 = padding row)
    block_tables: torch.Tensor  # [S, max_blocks] int32 KV blocks of each sequence
    mamba_src: torch.Tensor  # [S] int64 state slot each sequence reads (-1 = padding)
    mamba_dst: torch.Tensor  # [S] int64 state slot each sequence writes
    logits_indices: torch.Tensor  # [S] int64 token whose hidden state feeds sampling
    # Speculative decoding: decode rows are `decode_width` tokens wide (input token, drafts,
    # padding); row i starts from state slot mamba_src[i] and writes the state after its
    # position j to verify_dst[j, i] ([decode_width, num_decode] int64, each position's
    # row contiguous; -1 = padding); None when width 1.
    decode_width: int = 1
    verify_dst: torch.Tensor | None = None
    # Prefix caching: Mamba states the prefill chunks also write from inside themselves
    # (checkpoints at interval positions); None when the step has none.
    state_saves: StateSaves | None = None
    # Prefix caching on a model whose prefill clamps dt (the prompt-only dt limit): [S]
    # int32, zeroed by the step's copy; a Mamba layer sets row i's entry to 1 when a
    # generated token of the row has a dt the limit would have clamped (see
    # `KernelOps.ssm_state_update`). None: nothing is checked.
    dt_limit_hits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decode rows (they come first)."""
        return self.num_decode * self.decode_width
