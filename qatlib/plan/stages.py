"""The terms of each stage: which memory each one needs, and which code that models (see the
package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model import ModelShape, PlanInputs, StagePlan, Term, WeightFormat

GIB = 1 << 30
CHUNK_ELEMENTS = 1 << 25  # qatlib.losses.CHUNK_ELEMENTS: logits elements per KD chunk
CHUNK_COPIES = 6  # fp32 copies of a chunk alive at once: s, t, log p_s, log p_t, p_t, grad
SAVE_SHARD_BYTES = 512 << 20  # qatlib.zero3.save.save_consolidated's max_shard_bytes
PARTITION_BYTES = 64 << 20  # qatlib.zero3.io.PARTITION_BYTES: above it, assembled from partitions
COPY_BYTES = 64 << 20  # qatlib.checkpoint.st_write.COPY_BYTES: a shard is assembled this much at a time
# Per process, beyond the terms: interpreter + torch + transformers (+ DeepSpeed) resident set; on
# GPUs the host side of the CUDA context and pinned buffers, and on the device the context and
# the caching allocator's slack. CPU value measured here (docs/NOTES: 0.45-0.55 GiB a tiny rank).
PROCESS_HOST = {"cpu": int(0.6 * GIB), "gpu": 3 * GIB}
DEVICE_BASE = 1 * GIB
STAGES = ("ptq_calibrate", "zero3_qat", "convert_export", "evaluate")
# Rough throughput for `runtime` (minutes, x2 margin): GPU bf16 ~10% of an H100 peak (MoE under ZeRO-3); a CPU thread.
GPU_FLOPS, CPU_FLOPS_PER_THREAD = 100e12, 10e9
# ZeRO-3 all-gathers the weights for every forward / backward pass: bytes per second of a rank's
# gather (NVLink-class / gloo on one host), and the windows an evaluation source reads (no limit).
GATHER_BYTES_PER_S = {"gpu": 100e9, "cpu": 1e9}
EVAL_WINDOWS = 2000


# ----------------------------------------------------------------------------- the terms
def act_per_token(m: ModelShape, d: int, act_quant: bool, moe: bool) -> int:
    """Bytes autograd keeps per token for one decoder layer without checkpointing: attention's
    layer input, normed input, q/k/v before and after norm + RoPE, SDPA output (+ its fp32 LSE per
    head), the o_proj input; the MLP's residual and normed input, the router's fp32 logits and
    probabilities, and per routed copy (top-k) the expert input, gate/up outputs, activation and
    down output (+ the shared experts' on every token). Activation fake-quant keeps one more copy
    of each quantized input. Attention is sized as a full-attention layer's (q / k widths of MLA
    included) for every layer: linear-attention layers keep less per token."""
    h, q, kv, aq = m.hidden, m.q_width, m.kv_width, int(act_quant)
    attn = d * (2 * h + aq * h + 2 * q + 4 * kv + q + aq * q) + 4 * m.heads
    if moe:
        i, k = m.moe_intermediate, m.top_k
        mlp = d * (2 * h + aq * h) + 4 * 2 * m.experts + k * d * (2 * h + aq * h + 3 * i + aq * i)
        s = m.shared_width  # the shared experts run on every token: gate/up outputs, activation, down
        mlp += d * (3 * s + aq * s + h) if s else 0
    else:
        i = m.intermediate
        mlp = d * (3 * h + aq * h + 3 * i + aq * i)
    return attn + mlp


def _logits(m: ModelShape, tokens: int, d: int, kd: bool) -> list[Term]:
    """`qatlib.losses`' chunked objective: model-dtype logits (and the teacher's), the gradient
    buffer shaped like them, one chunk's fp32 working set (all rows when they fit one chunk)."""
    rows = min(tokens, max(1, CHUNK_ELEMENTS // m.vocab))
    out = [Term("student logits", tokens * m.vocab * d, f"{tokens} tokens x vocab {m.vocab}")]
    if kd:
        out.append(Term("KD teacher logits (no grad)", tokens * m.vocab * d))
    out.append(Term("logits gradient buffer", tokens * m.vocab * d))
    note = f"{rows} rows x vocab x fp32 x {CHUNK_COPIES} (CHUNK_ELEMENTS {CHUNK_ELEMENTS})"
    out.append(Term("KD/LM chunk fp32 working set", rows * m.vocab * 4 * CHUNK_COPIES, note))
    return out


def _n_scales(m: ModelShape, w: WeightFormat, inputs: bool) -> int:
    """Weight scales of every quantized linear, plus its static input scale when ``inputs``."""
    return sum(w.scales(o, i) + inputs for lin, moe in m.layer_kinds() for o, i in m.layer_linears(moe, lin))


def _persistent(m: ModelShape, threshold: int, cap: int | None) -> int:
    """Parameters DeepSpeed keeps whole on every rank: in model order, each of at most
    ``threshold`` elements (``stage3_param_persistence_threshold``) while the running total stays
    within ``cap`` (``stage3_model_persistence_threshold``; DeepSpeed's
    ``mark_persistent_parameters``). Quantizer scales are left out (a few per linear)."""
    sizes = [m.vocab * m.hidden]  # in transformers' parameter order (within a layer: near enough)
    for lin, moe in m.layer_kinds():
        sizes += [o * n for o, n in m.attn_linears(lin)] + m.attn_small(lin)
        sizes += m.mlp_small(moe)[:1] + [o * n for o, n in m.mlp_linears(moe)] + m.mlp_small(moe)[1:]
        sizes += [m.hidden] * m.norms  # input / post-attention (Gemma 3: + pre / post-MLP) norms
    sizes += [m.hidden] + ([] if m.tied else [m.vocab * m.hidden])
    total, limit = 0, cap if cap is not None else float("inf")
    for n in sizes:
        if n <= threshold and total + n <= limit:
            total += n
    return total


@dataclass(frozen=True)
class Run:
    """Where the stages run: ``gpus`` per node (0: CPU ranks), ``nodes``, capacities in bytes."""

    gpus: int = 0
    nodes: int = 1
    cpu_ranks: int = 2
    gpu_mem: int = 80 * GIB
    node_mem: int = 1024 * GIB
    threads: int = 2

    @property
    def ranks_per_node(self) -> int:
        return self.gpus or self.cpu_ranks


def _minutes(flops: float, run: Run, devices: int, io_bytes: float = 0) -> int:
    rate = devices * GPU_FLOPS if run.gpus else max(1, run.threads) * CPU_FLOPS_PER_THREAD
    seconds = flops / rate + io_bytes / 0.5e9
    return 10 + math.ceil(2 * seconds / 60)


def _place(
    stage: str,
    work: list[Term],
    host_each: list[Term],
    node: list[Term],
    procs: int,
    run: Run,
    on_device: bool,
    minutes: int,
    notes: list[str],
) -> StagePlan:
    """A rank's working set goes to its device (GPU) or into host RAM (CPU run, CPU stage)."""
    gpu = on_device and run.gpus > 0
    each = [
        Term("process (interpreter, torch, libraries)", PROCESS_HOST["gpu" if gpu else "cpu"]),
        *host_each,
    ]
    if gpu:
        device = [*work, Term("CUDA context + allocator slack", DEVICE_BASE)]
    else:
        device, each = [], [*work, *each]
    cap = run.gpu_mem if device else 0
    return StagePlan(stage, procs, device, each, node, cap, run.node_mem, minutes, notes)


def _ptq(m: ModelShape, x: PlanInputs, run: Run) -> StagePlan:
    d, layer = x.dtype_bytes, m.largest_layer * x.dtype_bytes
    # Measured (benchmarks/plan_rehearsal.py, qwen3-30b-a3b-width at 1 layer: 1.72 GiB against the
    # 3.72 GiB the earlier terms gave): the streamed PTQ holds the input embeddings only while it
    # captures the first layer's inputs and offloads them before any layer is onloaded; the head
    # (ignored) is never onloaded; and the experts are read per expert from the shards (the hub's
    # and save_pretrained's key layout) into the linearised skeleton, so no fused tensor exists.
    # Not streamed (`qatlib.plan.model.streamed`: GPTQ, or a static input scale on the head): the
    # model is loaded whole (placed by device_map) and calibrated in place.
    emb = m.vocab * m.hidden
    if x.ptq_streamed:
        first = Term(
            "one decoder layer or the input embeddings, the larger (never resident together)",
            max(m.largest_layer, emb) * d,
            f"layer {m.largest_layer:,} / embed_tokens {emb:,} params",
        )
    else:
        why = (
            "GPTQ changes the weights"
            if x.gptq
            else "SmoothQuant changes the weights"
            if x.smooth
            else "a static input scale on the head"
        )
        first = Term("the model, loaded whole (not streamed)", m.total_params * d, why)
    work = [first]
    reads_data = x.calib or x.gptq or x.smooth
    if reads_data:
        tok = x.calib_batch * x.seq_len
        if x.ptq_streamed or x.gptq:  # layer by layer: every sample's layer input is kept
            carried = 2 * x.calib_samples * x.seq_len * m.hidden * d
            work.append(
                Term(
                    "calibration activations carried (in + out)", carried, f"{x.calib_samples} x {x.seq_len}"
                )
            )
        else:  # the whole model's forward, one batch at a time: its logits too
            work.append(Term("logits of one batch", tok * m.vocab * d, f"{x.calib_batch} x {x.seq_len}"))
        work.append(
            Term("layer forward working set (one batch)", tok * act_per_token(m, d, x.act_quant, True))
        )
    if x.gptq:
        hessians = max(sum(i * i * 4 for _, i in m.layer_linears(moe, lin)) for lin, moe in m.layer_kinds())
        work.append(Term("GPTQ Hessians (one layer)", hessians))
    work.append(Term("fake-quant temporaries (one linear)", m.largest_linear * (d + 4)))
    work.append(Term("scales being written (fp32)", _n_scales(m, x.weight, x.act_quant) * 4))
    # GPU: a layer is read into host memory, then copied to the device; CPU: it is read in place
    host = [Term("read staging (one layer from the shards)", layer)] if run.gpus and x.ptq_streamed else []
    tokens = x.calib_samples * x.seq_len if reads_data else 0
    mins = _minutes(2 * m.active_params * tokens, run, 1, m.total_params * d)
    return _place("ptq_calibrate", work, host, [], 1, run, True, mins, [])


def _qat(m: ModelShape, x: PlanInputs, run: Run) -> StagePlan:
    d = x.dtype_bytes
    zero3 = x.zero3 and not x.blockwise
    procs = run.ranks_per_node if zero3 else 1
    world = procs * run.nodes if zero3 else 1
    threshold = x.persistence_threshold if x.persistence_threshold is not None else 10 * m.hidden
    persist = _persistent(m, threshold, x.model_persistence) if zero3 else 0
    shard = (m.total_params - persist) * d // world
    scales = _n_scales(m, x.weight, x.act_quant) if x.train_scales else 0
    work = [Term("parameter shard (model / world)", shard, f"{m.total_params:,} params / {world}")]
    unit_params = m.largest_layer  # what one gather holds: the consolidated save gathers the same units
    if zero3:
        work.append(
            Term("persistent small parameters (replicated)", persist * d, f"<= {threshold} elements each")
        )
        prefetch = x.prefetch if x.prefetch is not None else int(0.9 * m.hidden * m.hidden)
        # what one fetch gathers: a MoE layer's experts together (qatlib's leaf, the default) or one
        # expert / one linear at a time (`expert_leaf`); the embeddings and the head above 64 MiB
        # are computed from the partitions a block of rows at a time (`qatlib.zero3.vocab_parallel`; the
        # head's backward adds fp32 rows of at most 64 MiB), smaller ones gathered whole
        emb = m.vocab * m.hidden
        if emb * d > PARTITION_BYTES:
            emb = (2 * PARTITION_BYTES) // d
        if x.expert_leaf and m.moe_layers:
            unit_params = max(m.per_expert, m.largest_linear)
            name = "gathered unit (one expert or linear, or the embeddings / a 64 MiB block of them + 64 MiB fp32, + prefetch)"
        else:
            name = "gathered unit (one decoder layer, or the embeddings / a 64 MiB block of them + 64 MiB fp32, + prefetch)"
        work.append(Term(name, (max(unit_params, emb) + prefetch) * d))
    opt = Term(
        "trainable scales: param + fp32 master + grad + Adam m, v", scales * 20 // world, f"{scales:,} scales"
    )
    tokens = x.micro_batch * x.seq_len
    layer_act = tokens * act_per_token(m, d, x.act_quant, m.moe_layers > 0)
    if x.grad_ckpt:
        acts = [
            Term("checkpointed layer inputs", m.layers * tokens * m.hidden * d, f"{m.layers} layers"),
            Term("one layer recomputed in backward", layer_act),
        ]
        if zero3 and x.expert_leaf and m.moe_layers:
            if x.ckpt_reentrant:
                # the recompute gathers every expert; DeepSpeed holds them to the layer's end
                experts = m.experts * m.per_expert * d
                acts.append(Term("a layer's frozen experts held through its recompute (reentrant)", experts))
            else:  # `qatlib.surgery.moe.recompute_experts_one_by_one`: their shared input, indices, weights
                kept = m.moe_layers * tokens * (m.hidden * d + m.top_k * (16 + d))
                acts.append(Term("experts' inputs kept (each expert recomputed in its own backward)", kept))
    else:
        acts = [Term("activations of every layer (no checkpointing)", m.layers * layer_act)]
    if x.eager_attention:
        acts.append(Term("eager attention scores", x.micro_batch * m.heads * x.seq_len**2 * d))
    work += acts + [
        Term("fake-quant temporaries (one linear, not kept for backward)", 2 * m.largest_linear * (d + 4)),
        *_logits(m, tokens, d, x.kd),
    ]
    if x.separate_teacher and x.kd:  # `qatlib.trainers.end2end.base_model_teacher`
        work.append(Term("teacher: the original model, a second copy (model / world)", shard))
    else:
        work.append(
            Term("teacher: the model itself, quantization disabled", 0, "no second copy of the weights")
        )
    # ZeRO-3 reads a tensor above the load chunk (64 MiB = PARTITION_BYTES) into the partitions
    # piece by piece (`qatlib.zero3.load`): rank 0 stages one piece, never the whole tensor
    staged = min(m.vocab * m.hidden * d, PARTITION_BYTES) if zero3 else m.vocab * m.hidden * d
    host_each = [Term("load staging (largest tensor; under ZeRO-3 one piece of it, at most 64 MiB)", staged)]
    if x.offload_optimizer:
        host_each.append(Term("offloaded optimizer state", scales * 16 // world))
        opt = Term(opt.name.replace("fp32 master + grad + Adam m, v", "grad"), scales * 4 // world)
    if x.offload_param:
        host_each.append(Term("offloaded parameter shard", shard))
        work[0] = Term(work[0].name + " (offloaded)", 0)
    if x.train_weights:  # quant_config.weight_lr: DeepSpeed's fp32 master + grad + Adam m, v per weight
        weights = m.total_params - persist
        work.insert(1, Term("trained weights: fp32 master + grad + Adam m, v", weights * 16 // world))
    work.insert(1, opt)
    emb = m.vocab * m.hidden * d
    if zero3 and emb > PARTITION_BYTES:  # streamed to a shard of its own, one piece (<= 64 MiB) at a time
        save = SAVE_SHARD_BYTES + unit_params * d
    else:
        save = SAVE_SHARD_BYTES + max(unit_params * d, emb)
    save = min(m.total_params * d, save)
    name = "rank 0: consolidated-save buffer (one shard + one unit or embedding; tensors above 64 MiB stream; + scales)"
    node = [Term(name, save + scales * 4)]
    if x.max_steps > 0:
        train_tokens = x.max_steps * tokens * world
    else:
        train_tokens = x.train_samples * x.epochs * x.seq_len
    per_token = 6 + 2 * x.grad_ckpt + 2 * x.kd
    steps = math.ceil(train_tokens / (tokens * world))
    gathers = steps * (2 + x.grad_ckpt + x.kd) * m.total_params * d  # fwd, bwd, recompute, teacher
    gather_s = gathers / GATHER_BYTES_PER_S["gpu" if run.gpus else "cpu"] if zero3 else 0
    mins = _minutes(per_token * m.active_params * train_tokens, run, world, m.total_params * d / world)
    mins += math.ceil(2 * gather_s / 60)
    notes = [f"world size {world}" + ("" if zero3 else " (no ZeRO-3: one process)")]
    return _place("zero3_qat", work, host_each, node, procs, run, True, mins, notes)


def _export(m: ModelShape, x: PlanInputs, run: Run) -> StagePlan:
    """The streamed export (``scripts/export.py``, its default; `qatlib.export.stream`). The input
    checkpoint is read one layer at a time, never a shard; each output tensor is spilled to disk
    as it is computed (`qatlib.checkpoint.st_write.ShardWriter`) and each shard assembled from the
    spill 64 MiB at a time: what is held is one output tensor (the embeddings or the head, kept
    unquantized, are the largest), one onloaded layer and one linear's compression temporaries
    (measured before the spill, benchmarks/plan_rehearsal.py: the output shard as it filled was
    the peak, 4.62 GiB for a 3.48 GiB model)."""
    d, layer = x.dtype_bytes, m.largest_layer * x.dtype_bytes
    out_tensor = max(m.vocab * m.hidden * d, m.largest_linear * x.weight.bits // 8)
    work = [
        Term("one output tensor (spilled to disk as it is written)", out_tensor),
        Term("shard assembly buffer (copied from the spill)", COPY_BYTES),
        Term("one decoder layer onloaded (weights)", layer),
        Term(
            "one linear's compression temporaries (fp32 dequantized + fp32 check)", 2 * m.largest_linear * 4
        ),
        Term("scales (fp32)", _n_scales(m, x.weight, x.act_quant) * 4),
    ]
    return _place(
        "convert_export", work, [], [], 1, run, False, _minutes(0, run, 1, 2 * m.total_params * d), []
    )


def _evaluate(m: ModelShape, x: PlanInputs, run: Run) -> StagePlan:
    """The peak over the variants: bf16 / ptq / qat hold the model in its dtype (ptq / qat also
    fake-quantize one linear at a time); the export variant decompresses module by module."""
    d = x.dtype_bytes
    tokens = x.eval_batch * x.eval_seq
    codes = m.largest_layer * x.weight.bits // 8
    rest = [
        Term("one layer's forward (a batch)", tokens * act_per_token(m, d, x.act_quant, m.moe_layers > 0)),
        Term("logits (+ fp32 log-softmax)", tokens * m.vocab * (d + 4), f"{x.eval_batch} x {x.eval_seq}"),
        Term("fake-quant / decompression temporaries", max(2 * m.largest_linear * (d + 4), codes)),
    ]
    model = Term("model (resident)", m.total_params * d)
    host, notes = [Term("load staging (largest tensor)", m.vocab * m.hidden * d)], []
    if run.gpus and model.bytes + sum(t.bytes for t in rest) + DEVICE_BASE > run.gpu_mem:
        model = Term(
            "offloaded: embeddings + one layer on the device", (m.embed_params + m.largest_layer) * d
        )
        host = [Term("model in host RAM (layer-sequential offload)", m.total_params * d)]
        notes.append("the model does not fit one device: layer-sequential offload (slower)")
    windows = x.eval_limit or EVAL_WINDOWS
    mins = _minutes(
        2 * m.active_params * windows * x.eval_seq * max(1, x.eval_sources), run, 1, m.total_params * d
    )
    return _place("evaluate", [model, *rest], host, [], 1, run, True, mins, notes)


def plan(m: ModelShape, x: PlanInputs, run: Run) -> list[StagePlan]:
    """The four stages' plans (`STAGES` order)."""
    stages = [_ptq(m, x, run), _qat(m, x, run), _export(m, x, run), _evaluate(m, x, run)]
    for s in stages:  # what the plan could not size is said with every stage's figures
        s.not_computed = list(m.not_computed)
    return stages
