"""GPU checks (marked `gpu`, skipped without CUDA). scripts/gpu_check.sh runs them on a lent GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import Run, run_fsdprun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_compiled_training_on_one_gpu_reports_mfu_and_gpu_memory(tmp_path):
    proc = run_fsdprun(
        "train", "debug", "launch.device=cuda", "--nproc-per-node", "1",
        "precision.param_dtype=bf16", "compile.enabled=true", "model.dim=256",
        "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=688",
        "model.vocab_size=1024", "train.steps=20", "output.log_every=5",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=900,
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    assert run.start["backend"] == "nccl" and "NVIDIA" in run.start["device_name"]
    assert run.losses[-1] < run.losses[0]
    rank0 = run.summary["ranks"][0]
    assert (
        rank0["peak_allocated_bytes"] > 0
        and rank0["peak_reserved_bytes"] >= rank0["peak_allocated_bytes"]
    )
    if any(k in run.start["device_name"] for k in ("H100", "H200", "A100")):
        assert run.summary["throughput"]["mfu"] is not None
    # Step times come from device events (no synchronize per step): the steps between two
    # logging steps take what the host's clock saw of that window, within 15% (the window also
    # holds the logging step's host work and its loss read).
    times = run.summary["step_times_s"]
    assert all(t > 0 for t in times)
    last, prev = run.steps[-1], run.steps[-2]
    window = sum(times[prev["step"] : last["step"]])
    host = (last["step"] - prev["step"]) * 8 * 64 / last["tokens_per_s"]  # debug: 8 x 64 tokens
    assert window == pytest.approx(host, rel=0.15), (window, host)


def test_checkpoint_resume_on_gpu(tmp_path):
    args = ["launch.device=cuda", "--nproc-per-node", "1", "precision.param_dtype=fp32",
            "train.steps=6", "checkpoint.every_steps=3", "output.log_every=1"]  # fmt: skip
    # Sync saves: an async save still in flight when a rank dies is (rightly) incomplete, and
    # on a GPU the step after a save is far shorter than the save.
    ref = Run(run_fsdprun("train", "debug", *args, "--run-dir", str(tmp_path / "ref"),
                          cwd=tmp_path), tmp_path / "ref").check()  # fmt: skip
    env_fail = {"FSDPRUN_FAIL_AT": "0:4"}
    from conftest import fsdprun_env

    proc = run_fsdprun("train", "debug", *args, "--run-dir", str(tmp_path / "run"),
                       cwd=tmp_path, env=fsdprun_env(**env_fail))  # fmt: skip
    assert proc.returncode == 1
    proc = run_fsdprun("resume", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = {e["step"]: e["loss"] for e in Run(proc, tmp_path / "run").steps}
    for e in ref.steps:
        assert got[e["step"]] == pytest.approx(e["loss"], abs=1e-5)


def test_fsdp2_cpu_offload_with_clipping_on_gpu(tmp_path):
    # The clip all-reduces CPU gradients: the run's group must have gloo beside NCCL.
    proc = run_fsdprun(
        "train", "debug", "launch.device=cuda", "--nproc-per-node", "1", "fsdp.cpu_offload=true",
        "train.grad_clip=1.0", "train.steps=4", "output.log_every=1",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=900,
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    assert run.start["backend"] == "cpu:gloo,cuda:nccl"
    assert len(run.losses) == 4 and run.losses[-1] < run.losses[0]


def test_profile_with_memory_snapshot_on_gpu(tmp_path):
    import json
    import pickle

    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", "debug", "launch.device=cuda", "--nproc-per-node", "1", "train.steps=5",
        "profile.enabled=true", "profile.memory_snapshot=true", "--run-dir", str(run_dir),
        cwd=tmp_path, timeout=900,
    )  # fmt: skip
    run = Run(proc, run_dir).check()
    record = next(e for e in run.events if e["event"] == "profile")
    assert record["memory_snapshots"] == [str(run_dir / "profile" / "memory-rank-0.pickle")]
    snapshot = pickle.loads((run_dir / "profile" / "memory-rank-0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]  # allocations were recorded
    trace = json.loads((run_dir / "profile" / "rank-0.pt.trace.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # CUDA activity too


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel needs 2 CUDA devices")
def test_tensor_parallel_with_fsdp_on_nccl_trains_as_plain_fsdp2(tmp_path):
    """parallel.tp=2 on NCCL (one rank per GPU; 4 GPUs: tp 2 x dp 2): the same fp32 losses as
    plain FSDP2 on as many ranks, vocab-sharded logits under loss parallel on CUDA."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    args = ["launch.device=cuda", "--nproc-per-node", str(world), "precision.param_dtype=fp32",
            "model.n_kv_heads=4", "train.steps=6", "output.log_every=1"]  # fmt: skip
    runs = {}
    for name, extra in (("plain", []), ("tp", ["parallel.tp=2"])):
        proc = run_fsdprun("train", "debug", *args, *extra, "--run-dir", str(tmp_path / name),
                           cwd=tmp_path, timeout=900)  # fmt: skip
        runs[name] = Run(proc, tmp_path / name).check()
    tp = runs["tp"]
    assert tp.start["backend"] == "nccl" and tp.start["mesh"][-1] == ["tp", 2]
    # TF32 stays off for fp32 matmuls by default; the split only reorders sums.
    assert tp.losses == pytest.approx(runs["plain"].losses, rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp and cp need 2 CUDA devices")
def test_offload_and_compile_under_tp_and_cp_on_nccl_train_as_one_gpu(tmp_path):
    """On NCCL (one rank per GPU, 2 GPUs): tp 2 and cp 2 with fsdp.cpu_offload (FSDP2 offloads
    the TP-split parameters; gloo beside NCCL for the CPU gradients' clip), and compiled cp 2
    (inductor's CUDA kernels around the all-to-all), each against one GPU, fp32. On CPU gloo
    ranks these are exact to 1e-5 (tests/test_composition.py, tests/test_cp.py)."""
    args = ["launch.device=cuda", "precision.param_dtype=fp32", "model.n_kv_heads=4",
            "train.steps=4", "output.log_every=1", "train.grad_clip=1.0"]  # fmt: skip
    runs = {}
    cases = {"one": (1, []), "tp-offload": (2, ["parallel.tp=2", "fsdp.cpu_offload=true"]),
             "cp-offload": (2, ["parallel.cp=2", "fsdp.cpu_offload=true"]),
             "cp-compile": (2, ["parallel.cp=2", "compile.enabled=true"])}  # fmt: skip
    for name, (nproc, extra) in cases.items():
        run_dir = tmp_path / name
        proc = run_fsdprun("train", "debug", *args, *extra, "--nproc-per-node", str(nproc),
                           "--run-dir", str(run_dir), cwd=tmp_path, timeout=900)  # fmt: skip
        runs[name] = Run(proc, run_dir).check()
    assert runs["tp-offload"].start["backend"] == "cpu:gloo,cuda:nccl"
    for name, run in runs.items():
        assert run.losses == pytest.approx(runs["one"].losses, rel=1e-4), name


@pytest.mark.skipif(
    torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (8, 9),
    reason="torchao's float8 TP styles need 2 CUDA devices of capability >= 8.9",
)
def test_float8_tp_styles_on_nccl_train_as_one_rank_float8(tmp_path):
    """precision.float8=tensorwise at tp 2 on NCCL: the float8 Linears take torchao's float8 TP
    styles (float8 all-gathers of activations, which gloo cannot send, so the CPU test runs
    torch's styles), and train as one rank's float8 run of the same micro-batches. fp32
    weights; rel 1e-4, as the plain TP test (the split reorders sums, and float8 rounds a value
    that moves in its last bit to the neighbouring float8 value now and then)."""
    args = ["launch.device=cuda", "precision.param_dtype=fp32", "precision.float8=tensorwise",
            "model.n_kv_heads=4", "train.steps=6", "output.log_every=1",
            "train.micro_batch_size=4"]  # fmt: skip
    runs = {}
    for name, extra in (("one", ["--nproc-per-node", "1"]),
                        ("tp", ["--nproc-per-node", "2", "parallel.tp=2"])):  # fmt: skip
        proc = run_fsdprun("train", "debug", *args, *extra, "--run-dir", str(tmp_path / name),
                           cwd=tmp_path, timeout=900)  # fmt: skip
        runs[name] = Run(proc, tmp_path / name).check()
    tp = runs["tp"]
    assert tp.start["mesh"] == [["dp_shard", 1], ["tp", 2]] and "14 converted" in tp.start["float8"]
    assert tp.losses == pytest.approx(runs["one"].losses, rel=1e-4)


def test_packed_chat_rows_on_cuda_train_as_the_dense_mask_path_on_cpu(tmp_path):
    """Chat fine-tuning with packed rows on the built-in Llama: on CUDA the document mask is a
    FlexAttention BlockMask, on CPU the dense boolean mask. From the same weights (a CPU
    checkpoint, since the two devices' generators draw different initial values), fp32, the
    step losses agree; the trained-target count (all-reduced each step) is the same."""
    common = ["sft-demo", "model.hf_path=null", "model.init=random", "model.max_seq_len=256",
              "--nproc-per-node", "1", "precision.param_dtype=fp32", "eval.every_steps=0",
              "output.log_every=1"]  # fmt: skip
    base = Run(run_fsdprun("train", *common, "launch.device=cpu", "train.steps=1",
                           "--run-dir", str(tmp_path / "base"), cwd=tmp_path),
               tmp_path / "base").check()  # fmt: skip
    (ckpt,) = (tmp_path / "base" / "checkpoints").iterdir()
    runs = {}
    for device in ("cpu", "cuda"):
        proc = run_fsdprun("train", *common, f"launch.device={device}", "train.steps=6",
                           f"checkpoint.load_from={ckpt}", "--run-dir", str(tmp_path / device),
                           cwd=tmp_path, timeout=900)  # fmt: skip
        runs[device] = Run(proc, tmp_path / device).check()
    assert base.losses and "NVIDIA" in runs["cuda"].start["device_name"]
    assert runs["cuda"].losses[0] == pytest.approx(runs["cpu"].losses[0], rel=1e-5)
    assert runs["cuda"].losses == pytest.approx(runs["cpu"].losses, rel=1e-4)
    trained = {d: [e["trained_tokens"] for e in r.steps] for d, r in runs.items()}
    assert trained["cuda"] == trained["cpu"] and min(trained["cuda"]) > 0


def test_nonfinite_step_is_skipped_on_the_device(tmp_path):
    """The fused AdamW step is queued before the host reads the step's flags, with the
    non-finite flag as its found_inf: a poisoned step must leave weights, moments and the step
    count exactly as they were (the CPU test of test_faults, on CUDA)."""
    from conftest import assert_same_state, fsdprun_env

    from fsdprun.checkpoint import step_dir

    proc = run_fsdprun(
        "train", "debug", "launch.device=cuda", "--nproc-per-node", "1", "train.steps=4",
        "checkpoint.every_steps=1", "checkpoint.keep_last=0", "output.log_every=1",
        "train.nonfinite=skip", "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
        env=fsdprun_env(FSDPRUN_NONFINITE_AT="0:3"), timeout=600,
    )  # fmt: skip
    run = Run(proc, tmp_path / "run").check()
    assert [e["skipped"] for e in run.steps] == [False, False, True, False]
    assert_same_state(step_dir(run.run_dir, 2), step_dir(run.run_dir, 3), tmp_path)
    assert run.steps[3]["loss"] < run.steps[0]["loss"]


def test_cp_alltoall_takes_the_fused_sdpa_kernels_for_plain_rows(tmp_path):
    """Plain rows reach SDPA through the all-to-all with no mask and is_causal (tests/test_cp.py
    checks the call on CPU), which on CUDA in bf16 is what the flash and cuDNN kernels take:
    forward and backward of the debug Llama and the shipped HF Llama folder with SDPA
    restricted to those two (it raises where neither takes the inputs), in a cp group of this
    one GPU (the exchange is then a copy; the layout attention sees is the gathered one)."""
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fsdprun.config import load_recipe
    from fsdprun.engines.cp import apply_cp
    from fsdprun.models import build_model
    from fsdprun.models.hf import HFCausalLM

    folder = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
        cfg = load_recipe("debug", ["model.dim=256", "model.n_heads=4"]).config  # head_dim 64
        for model in (build_model(cfg.model), HFCausalLM.from_folder(folder)):
            model = model.to("cuda", torch.bfloat16)
            if hasattr(model, "init_buffers"):
                model.init_buffers(torch.device("cuda"))
            apply_cp(model, mesh=mesh)
            tokens = torch.randint(0, 256, (2, 64), device="cuda")
            positions = torch.arange(64, device="cuda").expand(2, -1)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                logits = model(tokens, positions=positions)
                logits.float().sum().backward()
            assert logits.isfinite().all()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp_on_nccl_trains_as_plain_fsdp2(tmp_path):
    """parallel.cp=2 on NCCL, the all-to-all and the ring (zig-zag chunks, its point-to-point
    sends on NCCL), one rank per GPU: the fp32 losses of plain FSDP2 on as many ranks."""
    args = ["launch.device=cuda", "--nproc-per-node", "2", "precision.param_dtype=fp32",
            "train.steps=6", "output.log_every=1"]  # fmt: skip
    runs = {}
    for name, extra in (("plain", []), ("alltoall", ["parallel.cp=2"]),
                        ("ring", ["parallel.cp=2", "parallel.cp_impl=ring"])):  # fmt: skip
        proc = run_fsdprun("train", "debug", *args, *extra, "--run-dir", str(tmp_path / name),
                           cwd=tmp_path, timeout=900)  # fmt: skip
        runs[name] = Run(proc, tmp_path / name).check()
    for name in ("alltoall", "ring"):
        assert runs[name].start["cp_impl"] == name and runs[name].start["backend"] == "nccl"
        # TF32 stays off for fp32 matmuls by default: the split only reorders sums.
        assert runs[name].losses == pytest.approx(runs["plain"].losses, rel=1e-4), name
