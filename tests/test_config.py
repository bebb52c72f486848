"""`EngineConfig` option types: a value of the wrong type is a ValueError naming the field
and showing the value (before any default, comparison or model load could trip on it);
the values of the right type that worked before still do. Malformed devices and seeds out
of a generator's range are ValueErrors too."""
import re
from dataclasses import fields

import pytest
import torch

from hybrid_engine import LLM, EngineConfig

# One wrong-typed value per way a field's type can be missed: bools where ints go (True is an
# int in Python), ints and strings where bools go, floats where ints go, strings where numbers go.
BAD_TYPES = [
    ("model", 5),
    ("model", b"preset:x"),
    ("device", 0),
    ("dtype", ["bfloat16"]),  # unhashable: the `in DTYPES` check raised TypeError
    ("dtype", None),
    ("async_scheduling", "no"),
    ("async_scheduling", 0),
    ("cuda_graphs", 1),
    ("max_num_seqs", True),
    ("max_num_seqs", 4.0),
    ("max_num_batched_tokens", "2048"),
    ("max_model_len", 64.5),
    ("kv_block_size", True),
    ("num_kv_blocks", 1.5),
    ("gpu_memory_utilization", "a"),
    ("gpu_memory_utilization", True),
    ("seed", "x"),
    ("seed", 1.0),
    ("seed", None),
    ("load_format", 1),
    ("inject_rejection_rate", "0.5"),
    ("inject_rejection_rate", False),
    ("mamba_ssm_cache_dtype", 32),
    ("enable_prefix_caching", "yes"),
    ("enable_prefix_caching", None),
    ("prefix_cache_max_checkpoints", 2.0),
    ("prefix_cache_max_checkpoints", False),
    ("prefix_cache_checkpoint_interval", True),
    ("tensor_parallel_size", True),
    ("tensor_parallel_size", 2.0),
    ("enable_expert_parallel", 1),
]


def _assert_names_field_and_value(error: pytest.ExceptionInfo, field: str, value: object) -> None:
    message = str(error.value)
    assert message.startswith(f"{field} must be "), message
    assert message.endswith(f"got {value!r}"), message


@pytest.mark.parametrize("field,value", BAD_TYPES)
def test_wrong_type_is_a_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as error:
        EngineConfig(**{"device": "cpu", field: value}).resolve()
    _assert_names_field_and_value(error, field, value)


def test_every_field_has_a_wrong_type_case():
    """speculative_config has validation of its own (tests/spec/test_config.py)."""
    assert {f.name for f in fields(EngineConfig)} - {"speculative_config"} == {field for field, _ in BAD_TYPES}


@pytest.mark.parametrize("field,value", [
    ("num_kv_blocks", 1.5), ("max_num_seqs", True), ("seed", "x"), ("async_scheduling", "no"),
    ("gpu_memory_utilization", "a"), ("model", 5),
])
def test_wrong_type_through_llm(field, value):
    """The values a tester passed to `LLM(...)`: rejected before anything is built."""
    with pytest.raises(ValueError, match=f"^{re.escape(field)} must be ") as error:
        LLM(**{"device": "cpu", field: value})
    _assert_names_field_and_value(error, field, value)


def test_right_types_still_resolve():
    """Ints are numbers (vLLM takes gpu_memory_utilization=1); None is the default of the
    optional fields; presets are model strings; bools are bools."""
    config = EngineConfig(model="preset:granite-4.0-h-micro", device="cpu", dtype="float32",
                          async_scheduling=False, cuda_graphs=False, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=None, kv_block_size=16, num_kv_blocks=None, gpu_memory_utilization=1,
                          seed=-3, load_format="dummy", inject_rejection_rate=0, mamba_ssm_cache_dtype="bfloat16",
                          enable_prefix_caching=False, prefix_cache_max_checkpoints=0,
                          prefix_cache_checkpoint_interval=32, tensor_parallel_size=1,
                          enable_expert_parallel=False).resolve()
    assert (config.max_num_seqs, config.gpu_memory_utilization, config.seed, config.async_scheduling) == (4, 1, -3,
                                                                                                         False)
    assert EngineConfig(device="cpu", gpu_memory_utilization=0.5, inject_rejection_rate=0.25).resolve().model is None


@pytest.mark.parametrize("device", ["cuda:x", "cuda:", "cpu:0", "gpu", "cuda:-1"])
def test_malformed_device_is_a_value_error(device):
    with pytest.raises(ValueError, match=re.escape(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")):
        EngineConfig(device=device).resolve()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_missing_cuda_index_is_a_value_error():
    device = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=re.escape(f"device {device!r}: this machine has")):
        EngineConfig(device=device).resolve()


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_seed_out_of_a_generator_range_is_a_value_error(seed):
    with pytest.raises(ValueError, match=re.escape(f"seed must be in [{-2**63}, {2**64 - 1}]")):
        EngineConfig(device="cpu", seed=seed).resolve()
    for edge in (-2**63, 2**64 - 1):
        assert EngineConfig(device="cpu", seed=edge).resolve().seed == edge


def test_numpy_numbers_are_numbers():
    """NumPy's ints and floats pass (and come out as Python's); NumPy's bools are not ints."""
    np = pytest.importorskip("numpy")
    config = EngineConfig(device="cpu", seed=np.int64(5), num_kv_blocks=np.int32(64),
                          gpu_memory_utilization=np.float32(0.5), inject_rejection_rate=0).resolve()
    assert (config.seed, config.num_kv_blocks, config.inject_rejection_rate) == (5, 64, 0.0)
    assert type(config.seed) is int and type(config.gpu_memory_utilization) is float
    with pytest.raises(ValueError, match="^max_num_seqs must be an integer"):
        EngineConfig(device="cpu", max_num_seqs=np.bool_(True)).resolve()
