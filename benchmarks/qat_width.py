"""One QAT step at Qwen3-30B-A3B's true width (issue #16): peak RSS and step time, before vs after.

    python -m benchmarks.qat_width [--runs 128:single 16:single,zero3] [--before-ref REF] [--cap-gb 5.8]

The model is Qwen3-30B-A3B's config (hidden 2048, 32/4 heads, head_dim 128, top-8 of 128 experts,
moe_intermediate 768, vocab 151,936) cut to ONE decoder layer, random bf16 weights saved as
sharded safetensors (``--runs`` also builds the same width with fewer experts, so the old code
fits the memory cap). Each variant runs in fresh processes: ``single`` (from_pretrained ->
prepare -> one step of AdamW on every scale) and ``zero3`` (2 gloo ranks, `zero3_load`), each
with and without gradient checkpointing, with ``fp8_static``, on ``--tokens`` tokens per rank.
``before`` is qatlib at ``--before-ref`` (default: the merge-base with main, extracted with
``git archive``), ``after`` this checkout; everything else is the same file. A watchdog samples
the RSS of each run's whole process tree and kills it above ``--cap-gb`` (recorded as
``exceeded_cap``): the machine is shared. Per rank: the peak RSS of the step (sampled every
10 ms) and of the whole run (``ru_maxrss``), the step's wall time. Targets (issue, scaled to one
layer): ZeRO-3 per-rank step peak <= 0.6 M + 1.5 GB (M = model bytes), step >= 5x faster.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import QWEN3_30B_A3B_WIDTH, RssSampler, rss_now, tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
# Qwen3-30B-A3B cut to one decoder layer (the expert count is a row's); run as a file, the workers
# import `benchmarks` from the repository root that `run_variant` puts on PYTHONPATH
WIDTH = dict(
    QWEN3_30B_A3B_WIDTH, num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096
)


def make_model(model_dir: Path, experts: int) -> int:
    """The width model (once per expert count); returns its bytes."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not (model_dir / "config.json").is_file():
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(**WIDTH, num_experts=experts, dtype="bfloat16")
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(model_dir, max_shard_size="1GB")
        del model
        ptq = model_dir / "ptq"  # scheme only: every scale keeps its init value (a miss), as in a cold start
        ptq.mkdir()
        from safetensors.torch import save_file

        from qatlib.quant import PRESETS

        (ptq / "quant_scheme.json").write_text(json.dumps(PRESETS["fp8_static"].to_dict()))
        save_file({"lm_head.weight_scale": torch.ones(1)}, str(ptq / "scales.safetensors"))
    return sum(tensor_bytes(model_dir).values())


def worker(args) -> None:
    """One variant in this process (``single``) or on this rank (``zero3``, under torchrun).

    One step written out on purpose, not `qatlib.trainers.end2end`: ``before`` runs this same code
    against an older qatlib, so the step uses only what every version has (`prepare`,
    `role_parameters`, `zero3_load.build_qat_model`, a plain AdamW) and times exactly one step."""
    import torch

    import qatlib
    from qatlib.quant import PRESETS, prepare
    from qatlib.quant.quantizer import role_parameters

    scheme = PRESETS["fp8_static"]
    model_dir = Path(args.model_dir)
    rank, engine = 0, None
    if args.mode == "zero3":
        import deepspeed

        from qatlib.zero3 import io as z
        from qatlib.zero3 import load as zl

        cfg = json.loads((ROOT / "config" / "deepspeed" / "zero3_cpu_test.json").read_text())
        cfg["bf16"] = {"enabled": True}
        ctx = z.init_zero3(cfg, timeout_s=1800)
        rank = z.get_rank()
        model = zl.build_qat_model(model_dir, ctx, scheme, from_ptq_ckpt=model_dir / "ptq")
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype))
        prepare(model, scheme)
    scales = {id(p) for _, p in role_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in scales)
    opt = torch.optim.AdamW([p for p in model.parameters() if id(p) in scales], lr=1e-5)
    if args.checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    if args.mode == "zero3":
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    model.train()
    ids = torch.randint(
        0, WIDTH["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(rank)
    )
    before = rss_now()
    with RssSampler(interval=0.01) as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        if engine is not None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rec = {
        "rank": rank,
        "qatlib": qatlib.__file__,
        "loss": float(loss),
        "step_seconds": round(seconds, 2),
        "step_cpu_seconds": round(cpu, 2),
        "rss_before_step": before,
        "rss_step_peak": max(peak.peak, before),
        # not `qatlib.zero3.io.peak_rss_bytes`: "before" runs a qatlib that may not have it
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if engine is not None:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, rec)
    else:
        everyone = [rec]
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(everyone))


def expert_layer(experts: int = 16, tokens: int = 32, rounds: int = 3) -> dict:
    """One MoE experts layer at the true width (``experts`` of Qwen3-30B-A3B's 128, top-8 of them
    per token), fp8_static, forward + backward on the scales, in this process with 1 thread:
    qatlib's `QuantLinear.forward` ("after") vs the former forward through `Quantizer`
    ("before", autograd through `fake_quantize`), alternated ``rounds`` times. Per variant: CPU
    seconds and the bytes autograd keeps for backward beyond the parameters themselves."""
    import torch
    from torch import nn

    from qatlib.quant import PRESETS, QuantLinear, prepare
    from qatlib.quant.linear import _linear
    from qatlib.surgery.moe import LinearizedMoeExperts

    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, inter, k = WIDTH["hidden_size"], WIDTH["moe_intermediate_size"], WIDTH["num_experts_per_tok"]
    holder = nn.Sequential(LinearizedMoeExperts(experts, h, inter, nn.SiLU(), torch.bfloat16))
    for p in holder.parameters():
        nn.init.normal_(p, std=0.02)
    prepare(holder, PRESETS["fp8_static"], ignore=())
    for n, p in holder.named_parameters():
        p.requires_grad_("_quantizer." in n)
    params = {p.untyped_storage().data_ptr() for p in holder.parameters()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, h, generator=g).bfloat16().requires_grad_(True)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1).bfloat16()
    after = QuantLinear.forward

    def before(self, xin):
        return _linear(self, xin, self.fake_quant_weight())

    out: dict = {"experts": experts, "tokens": tokens, "before": [], "after": []}
    for _ in range(rounds):
        for name, fwd in (("before", before), ("after", after)):
            QuantLinear.forward = fwd
            kept: dict[int, int] = {}

            def pack(t, kept=kept):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    kept[ptr] = t.untyped_storage().nbytes()
                return t

            c0 = time.process_time()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = holder[0](x, idx, w)
            y.float().square().sum().backward()
            out[name].append(
                {"cpu_seconds": round(time.process_time() - c0, 3), "kept_bytes": sum(kept.values())}
            )
            del y
    QuantLinear.forward = after
    med = {n: sorted(r["cpu_seconds"] for r in out[n])[len(out[n]) // 2] for n in ("before", "after")}
    out["weight_bytes"] = sum(
        p.numel() * p.element_size() for n, p in holder.named_parameters() if "_quantizer." not in n
    )
    out["speedup_cpu"] = round(med["before"] / med["after"], 2)
    out["kept_bytes_ratio"] = round(out["after"][0]["kept_bytes"] / max(out["before"][0]["kept_bytes"], 1), 4)
    return out


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_variant(code: str, mode: str, checkpointing: bool, model_dir: Path, args, out: Path) -> dict:
    """One variant in fresh processes under the RSS watchdog; the ranks' records or why none."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = f"{code}{os.pathsep}{ROOT}"
    wargs = ["--worker", mode, "--model-dir", str(model_dir), "--tokens", str(args.tokens)]
    wargs += ["--worker-out", str(out), "--dtype", args.dtype] + (
        ["--checkpointing"] if checkpointing else []
    )
    me = [str(Path(__file__).resolve())]
    cmd = [sys.executable, *me, *wargs]
    if mode == "zero3":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *me,
            *wargs,
        ]
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    reader = threading.Thread(target=lambda: [tail.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    tree_peak, killed = 0, False
    while proc.poll() is None:
        tree_peak = max(tree_peak, _tree_rss(proc.pid))
        if tree_peak > args.cap_gb * 2**30 and not killed:
            killed = True
            import psutil

            for q in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                q.kill()
        if time.perf_counter() - t0 > args.timeout_s and not killed:
            killed = True
            proc.kill()
        time.sleep(0.05)
    reader.join(5)
    rec = {"code": code, "mode": mode, "checkpointing": checkpointing, "tree_rss_peak": tree_peak}
    rec["wall_seconds"] = round(time.perf_counter() - t0, 1)
    if killed or proc.returncode != 0 or not out.is_file():
        over = tree_peak > args.cap_gb * 2**30
        rec["failed"] = "exceeded_cap" if over else ("timeout" if killed else "error")
        rec["log_tail"] = "".join(tail[-15:])
        return rec
    rec["ranks"] = json.loads(out.read_text())
    rec["step_seconds"] = max(r["step_seconds"] for r in rec["ranks"])
    rec["step_cpu_seconds"] = max(r["step_cpu_seconds"] for r in rec["ranks"])
    rec["max_rank_step_peak"] = max(r["rss_step_peak"] for r in rec["ranks"])
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["16:single", "16:zero3", "128:single", "16:single:ckpt", "16:zero3:ckpt", "128:single:ckpt"],
        help="EXPERTS:MODE[:ckpt][:after] rows, in order (':after': this checkout only; 2 ZeRO-3 ranks "
        "of the 128-expert model with the old code exceed the cap)",
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--before-ref", default=None, help="git ref of 'before' (default: merge-base with main)")
    ap.add_argument(
        "--cap-gb", type=float, default=5.8, help="kill a run whose process tree exceeds this RSS"
    )
    ap.add_argument("--timeout-s", type=float, default=1500)
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qatlib_width")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "qat_width.json")
    ap.add_argument("--worker", choices=["single", "zero3"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="single-process model dtype; float32 on a CPU, where the bf16 lm_head input gradient "
        "(grad @ W, 151,936 x 2048) takes minutes and hides everything else",
    )
    ap.add_argument("--skip-layer", action="store_true", help="skip the in-process expert-layer measurement")
    ap.add_argument("--build", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layer-only", action="store_true", help="only the in-process expert-layer measurement")
    args = ap.parse_args()
    if args.build:
        Path(args.model_dir, "bytes.json").write_text(
            json.dumps(make_model(Path(args.model_dir), args.build))
        )
        return
    if args.worker:
        args.mode = args.worker
        worker(args)
        return
    if args.layer_only:  # the in-process expert-layer measurement alone (seconds, not minutes)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"expert_layer": expert_layer()}, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    ref = (
        args.before_ref
        or subprocess.check_output(["git", "merge-base", "HEAD", "main"], cwd=ROOT, text=True).strip()
    )
    before = args.workdir / f"before-{ref[:12]}"
    if not before.is_dir():
        before.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", ref, "qatlib"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
    codes = {"before": str(before), "after": str(ROOT)}
    result: dict = {
        "dtype": args.dtype,
        "before_ref": ref,
        "after_head": _head(),
        "cap_gb": args.cap_gb,
        "tokens": args.tokens,
    }
    result["config"] = WIDTH
    if not args.skip_layer:
        result["expert_layer"] = expert_layer()
    result["runs"] = []
    for entry in args.runs:
        experts, mode, *flags = entry.split(":")
        experts, ckpt = int(experts), "ckpt" in flags
        # ":after": this checkout only (the old code does not fit the cap at this size)
        todo = {"after": codes["after"]} if "after" in flags else codes
        model_dir = args.workdir / f"width_e{experts}"
        # built in a child process: the parent's RSS stays small while the variants run
        build = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--build",
            str(experts),
            "--model-dir",
            str(model_dir),
        ]
        subprocess.run(build, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        model_bytes = json.loads((model_dir / "bytes.json").read_text())
        pair = {}
        for name, code in todo.items():
            print(f"[qat_width] e{experts} {mode} ckpt={ckpt} {name} ...", file=sys.stderr, flush=True)
            pair[name] = run_variant(code, mode, ckpt, model_dir, args, args.workdir / "w.json")
            print(f"   -> {_brief(pair[name])}", file=sys.stderr, flush=True)
        row = {"experts": experts, "model_bytes": model_bytes, "mode": mode, "checkpointing": ckpt, **pair}
        row.update(_ratios(pair, model_bytes, mode))
        result["runs"].append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # after every row: a kill loses little
    print(f"wrote {args.out}")


def _ratios(pair: dict, model_bytes: int, mode: str) -> dict:
    a, b = pair["after"], pair.get("before", {})
    out: dict = {}
    if "step_seconds" in a and "step_seconds" in b:
        # CPU time of the step (1 thread per process): what the work costs, whatever the machine's load
        out["speedup_cpu"] = round(b["step_cpu_seconds"] / max(a["step_cpu_seconds"], 1e-9), 2)
        out["speedup_wall"] = round(b["step_seconds"] / max(a["step_seconds"], 1e-9), 2)
        out["step_peak_ratio"] = round(a["max_rank_step_peak"] / b["max_rank_step_peak"], 3)
    if mode == "zero3" and "max_rank_step_peak" in a:
        target = 0.6 * model_bytes + 1.5e9
        out["target_rank_peak_bytes"] = target
        out["rank_peak_within_target"] = a["max_rank_step_peak"] <= target
    return out


def _brief(r: dict) -> str:
    if "failed" in r:
        return f"FAILED {r['failed']} (tree peak {r['tree_rss_peak'] / 2**30:.2f} GiB)"
    return f"step {r['step_seconds']} s ({r['step_cpu_seconds']} s CPU), rank step peak {r['max_rank_step_peak'] / 2**30:.2f} GiB"


def _head() -> str:
    return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()


if __name__ == "__main__":
    main()
