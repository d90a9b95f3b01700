"""`nn.Linear` whose bf16 CPU calls take the fastest kernel this host has for their row count, measured at load.

Inference runs three kinds of calls: one row (a decode step: a draft token, an `ar` step), a few rows (a verify of
1 + drafted tokens; a draft replica stepping several sessions) and many (a prefill). Which kernel is fastest for
each differs between CPUs by 2-5× (docs/benchmarks.md, "Kernels per host"): on one host `torch.mv` streams a
one-row bf16 weight fastest, on another the prepacked oneDNN kernel does. The candidates:
- `gemm`: `F.linear`. For a bf16 weight oneDNN re-lays the weight out on every call;
- `gemv`: `torch.mv(W, x)`, one row only;
- `packed`: the weight laid out for oneDNN once (`prepack`, `torch.ops.mkldnn._reorder_linear_weight`), then
  `mkldnn._linear_pointwise`: bit-identical to `gemm`, at the price of a second copy of the weight in memory;
- `int8` (`specdec.modeling.quant.Int8Linear` only): `torch._weight_int8pack_mm`;
- `stream` (hosts without native bf16 GEMMs only: `stream_supported`): the native streaming linear
  (`specdec.modeling.native.stream_linear`, AVX2 + FMA), which reads the weight once for up to 48 rows, bf16 or fp32,
  with fp32 arithmetic, and rounds every row alike whatever its call's row count. It reads the weight in its own layout
  (`Linear.stream_weight`), a second copy in memory as `packed`'s is; a layer whose plan never streams drops it.

`tune_linears(model)` times the candidates per distinct layer shape for 1, 4 and 8 rows, interleaved, and keeps the
fastest: a *plan*, one kernel per row class. Calls with more than 8 rows take `packed` where it exists, else the
faster of `gemm` and `stream` (timed at 32 rows), else `gemm`.

It then tunes *row padding*: oneDNN's kernels are not monotone in the row count. With weights streaming from memory
(a forward over all layers), one or two rows can cost more than four (default target, AMD host, 1 thread: the
gate/up projection 258 / 292 µs at 1 / 2 rows, 215 at 4; the head 4.0 / 4.4 ms against 3.2). So each group of
same-shaped layers is timed at 1..PAD_MAX_ROWS rows, one pass over the whole group per repeat (as a forward streams
them), and a call of r rows runs as the cheapest p ≥ r rows, zero rows appended and their outputs dropped, where that
is at least PAD_MARGIN faster (`Linear.pad_to`). A zero row changes no other row's result beyond the kernel's own
summation order.

Every kernel computes the same function up to float summation order, and a plan (and padding) is fixed once tuned,
so a model's outputs do not change while it serves. `SPECDEC_KERNEL_TUNE=0` skips the measurement and keeps each
class's DEFAULT_PLAN, unpadded (outputs then also repeat across processes). Measure the kernels with
`scripts/forward_cost.py`.

Row invariance (`set_row_invariant`, the target's layers; `SPECDEC_ROW_INVARIANT=0` turns it off): a row's result
must not depend on how many rows its call has, or a target's greedy output depends on the load (a decode step alone
is one row, batched with other sessions it is one of many) and on what tuning chose in this process. oneDNN's
one-row path rounds some rows unlike its multi-row one (default target, AMD host: 5 of 48 random rows of the
1536-wide down projection; `experiments/row_invariance.py`). So a row-invariant layer never runs a one-row oneDNN call:
one row runs as at least MIN_INVARIANT_ROWS rows (a zero row appended), or on `torch.mv` where that was tuned
fastest. oneDNN's AMX kernels also round a call of more than 32 rows unlike one of 2..32 rows (a batched verify of
8 sessions of 5 rows is 40), so a row-invariant layer runs a longer call as calls of at most MAX_INVARIANT_ROWS rows.
`tune_linears` then checks each shape (`check_row_invariance`, across that boundary) and moves a shape whose
`torch.mv` rounds unlike its multi-row kernel to the padded oneDNN call.

Native decoder layers: where every linear of a layer runs on `stream` for a call's row count, `CausalLM.forward`
runs the layer as one C call (`specdec.modeling.native.decoder_layer`: the same kernel, without the ~25 torch ops
between the linears). Per-layer timing here cannot see that gain, so after `tune_linears` a model that is not
row-invariant (a draft) compares whole forwards per row class, on `stream` against its tuned kernels, on any host where
the streaming kernel runs (`CausalLM.tune_native_layers`); a row-invariant target keeps one kernel family for every
row count.

The switches are `specdec.common.settings` fields: `kernel_tune`, `row_invariant`, and `onednn_cache_capacity`, the size
of oneDNN's kernel caches, which `settings.prepare_process()` sets before the first oneDNN call (the first model load
and `prepack_linears` call it).

Packing needs oneDNN's bf16 path, which runs only on CPUs with AVX512 (BW/VL/DQ) or AVX-NE-CONVERT
(`packing_supported`). Elsewhere (an AVX2-only CPU) nothing is packed and `packed` is never a candidate; `stream`
is, where the native kernels are built (`stream_supported`). There torch's GEMMs do not read the weight once for
several rows (default target, AMD EPYC: 8 rows cost 2.9× one row in fp32, 4.6× in bf16), the streaming kernel does,
so on such hosts fp32 layers are tuned too (the same candidates, on fp32 weights), `--dtype auto` picks bf16
(`specdec.modeling.dtypes.auto_dtype`), and with tuning off a bf16 layer's default plan runs on `stream`
(`default_plan`; an untuned fp32 layer keeps `F.linear`). Its rows round alike at any row count, so a row-invariant
layer on it needs no padding to two rows and no split; one whose tuned plan mixes it with `gemm` or `gemv` fails the
invariance check and moves to `stream` for every row count. On hosts with native bf16 GEMMs nothing of this applies:
fp32 layers run `F.linear`, as ever.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from specdec.modeling import native

from specdec.common import settings
from specdec.modeling.dtypes import cpu_has_fast_bf16

log = logging.getLogger(__name__)

ROW_CLASSES = (1, 4, 8)  # the row counts a plan is tuned at: a call with r rows uses the first class >= r
_TUNED: dict[tuple, tuple[str, ...]] = {}  # (class, shape, bias, threads, ..., dtype) → plan, for same-shaped layers
PAD_MAX_ROWS = 8  # calls of up to this many rows may run padded (Linear.pad_to)
PAD_MARGIN = 0.05  # a padded row count is taken only where it measured at least this much faster
MIN_INVARIANT_ROWS = 2  # a row-invariant layer's calls run as at least this many rows (see the module docstring)
MAX_INVARIANT_ROWS = 32  # ... and as calls of at most this many rows, a longer call split (see the module docstring)
_PADS: dict[tuple, tuple[int, ...]] = {}  # (class, shape, bias, threads, plan, layers, ..., dtype) → pad_to


def row_class(rows: int) -> int:
    """Index into a plan: 0 for one row, 1 for 2-4, 2 for 5-8, 3 (the prefill kernel) above."""
    return 0 if rows <= 1 else 1 if rows <= 4 else 2 if rows <= 8 else 3


def packing_supported() -> bool:
    """Whether `prepack` can lay bf16 weights out for oneDNN here: oneDNN is built in, has the packing op, and runs
    bf16 on this CPU (`specdec.modeling.dtypes.cpu_has_fast_bf16`; oneDNN refuses to pack bf16 weights elsewhere)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and cpu_has_fast_bf16())


def stream_supported() -> bool:
    """Whether `stream` is a candidate here: a host without native bf16 GEMMs (`cpu_has_fast_bf16` False, as on an
    AVX2-only CPU or with `specdec.common.settings` `isa` avx2) where the native streaming kernel runs (AVX2 + FMA, the
    native kernels on and built). Never on hosts with native bf16 GEMMs: their paths stay as they are."""
    return not cpu_has_fast_bf16() and native.stream_linear_supported()


STREAM_PLAN = ("stream",) * 4  # every row count on the streaming kernel: row-invariant by construction
_STREAM_DTYPES = (torch.bfloat16, torch.float32)
_stream_host: tuple[settings.RuntimeSettings, bool] | None = None  # (the settings it was asked under, answer)


def _streams_here() -> bool:
    """`stream_supported()`, asked once per settings object: untuned layers ask it on every call."""
    global _stream_host
    s = settings.get()
    if _stream_host is None or _stream_host[0] is not s:
        _stream_host = (s, stream_supported())
    return _stream_host[1]


def _tunable(m: nn.Module, stream: bool) -> bool:
    """A CPU `Linear` that `tune_linears` plans: bf16, and fp32 where `stream` (`stream_supported`) is a candidate."""
    return (isinstance(m, Linear) and m.weight.device.type == "cpu"
            and (m.weight.dtype is torch.bfloat16 or (stream and m.weight.dtype is torch.float32)))


def tuning_enabled() -> bool:
    """`specdec.common.settings` `kernel_tune` (SPECDEC_KERNEL_TUNE)."""
    return settings.get().kernel_tune


class Linear(nn.Linear):
    DEFAULT_PLAN: tuple[str, ...] = ("gemv", "packed", "packed", "packed")  # until tuned (or with tuning off)
    INVARIANT_PLAN: tuple[str, ...] = ("packed", "packed", "packed", "packed")  # the same, row-invariant
    plan: tuple[str, ...] | None = None  # kernel per row class (see row_class); None: DEFAULT_PLAN
    pad_to: tuple[int, ...] | None = None  # a call of r <= len(pad_to) rows runs as pad_to[r - 1] rows; None: r
    row_invariant: bool = False  # every row rounds alike whatever its call's row count (set_row_invariant)
    _packed: tuple[int, int, torch.Tensor] | None = None  # (weight data_ptr, weight version, packed weight)
    _streamed: tuple[int, int, torch.Tensor] | None = None  # the same for `stream`'s layout (stream_weight)

    def prepack(self, rows_hint: int = 4) -> bool:
        """Lay a bf16 CPU weight out for oneDNN once; returns whether it did. The packed copy is used only while the
        weight is the same tensor at the same version (an in-place update or a `.to()` makes it stale: ignored)."""
        w = self.weight
        if w.dtype is not torch.bfloat16 or w.device.type != "cpu" or not packing_supported():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)
        except RuntimeError:  # a oneDNN build without bf16 support on this CPU: keep F.linear
            return False
        self._packed = (w.data_ptr(), w._version, packed)
        return True

    def _packed_weight(self) -> torch.Tensor | None:
        p = self._packed
        return p[2] if p is not None and p[0] == self.weight.data_ptr() and p[1] == self.weight._version else None

    def stream_weight(self) -> torch.Tensor:
        """The weight as the streaming kernel reads it (`specdec.modeling.native.stream_pack`), packed on first use and
        again whenever the weight is another tensor or was changed in place. A copy, as large as the weight:
        `release_stream_weights` drops it from layers whose plan does not use `stream`."""
        w, p = self.weight, self._streamed
        if p is None or p[0] != w.data_ptr() or p[1] != w._version:
            self._streamed = p = (w.data_ptr(), w._version, native.stream_pack(w))
        return p[2]

    def kernels(self, rows: int) -> list[str]:
        """The kernels that can run a bf16 (or, where `stream_supported`, fp32) CPU call of `rows` rows on this
        layer now."""
        out = ["gemm"] + (["gemv"] if rows == 1 else [])
        out += ["packed"] if self._packed_weight() is not None else []
        stream = (self.weight.dtype in _STREAM_DTYPES and self.weight.device.type == "cpu"
                  and (self.bias is None or self.bias.dtype == self.weight.dtype) and stream_supported())
        return out + (["stream"] if stream else [])

    def run_kernel(self, kernel: str, x2: torch.Tensor) -> torch.Tensor:
        """`kernel` on a 2-D input [rows, in_features] → [rows, out_features] (a kernel that cannot run: gemm)."""
        if kernel == "gemv" and x2.shape[0] == 1:
            y = torch.mv(self.weight, x2[0])[None]
            return y if self.bias is None else y + self.bias
        if kernel == "packed":
            pw = self._packed_weight()
            if pw is not None:
                return torch.ops.mkldnn._linear_pointwise(x2, pw, self.bias, "none", [], "")
        if kernel == "stream" and x2.dtype in _STREAM_DTYPES and self.weight.dtype in _STREAM_DTYPES \
                and not (torch.is_grad_enabled() and (x2.requires_grad or self.weight.requires_grad)):
            # no autograd: a training call takes F.linear
            return native.stream_linear(x2, self.weight, self.bias, self.stream_weight())
        return F.linear(x2, self.weight, self.bias)

    def default_plan(self) -> tuple[str, ...]:
        """The plan until tuned (or with tuning off): DEFAULT_PLAN, or INVARIANT_PLAN for a row-invariant layer;
        where `stream_supported`, its torch and oneDNN entries run on `stream` instead."""
        plan = self.INVARIANT_PLAN if self.row_invariant else self.DEFAULT_PLAN
        if self.weight.dtype in _STREAM_DTYPES and _streams_here():
            return tuple("stream" if k in ("gemm", "gemv", "packed") else k for k in plan)
        return plan

    def kernel_for(self, rows: int) -> str:
        return (self.plan or self.default_plan())[row_class(rows)]

    def rows_to_run(self, rows: int) -> int:
        """The row count a call of `rows` rows runs as (row padding; a row-invariant layer never makes a one-row
        oneDNN call; `gemv` and `stream` round one row as they round it batched)."""
        run = self.pad_to[rows - 1] if self.pad_to is not None and rows <= len(self.pad_to) else rows
        if self.row_invariant and run < MIN_INVARIANT_ROWS and self.kernel_for(run) not in ("gemv", "stream"):
            return MIN_INVARIANT_ROWS  # never a one-row oneDNN call
        return run

    def streams(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `forward` on `rows` rows of a CPU input of `dtype` runs every one of them on the streaming
        kernel, with this layer's weight (and bias) of that dtype: then the native decoder layer may run it
        (`specdec.modeling.model.DecoderLayer.runs_natively`), the same kernel called from C."""
        w = self.weight  # an Int8Linear's is its dequantized weight, which its bf16 kernels (stream too) run on
        if w.dtype is not dtype or w.device.type != "cpu" or dtype not in _STREAM_DTYPES \
                or (dtype is torch.float32 and self.plan is None) or (self.bias is not None and self.bias.dtype is not dtype):
            return False
        calls = [rows] if not self.row_invariant or rows <= MAX_INVARIANT_ROWS \
            else [MAX_INVARIANT_ROWS, rows % MAX_INVARIANT_ROWS or MAX_INVARIANT_ROWS]
        return all(self.kernel_for(self.rows_to_run(r)) == "stream" for r in calls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 on a CPU: the plan; fp32 only where tuning gave it one (hosts where `stream_supported`)
        if x.device.type == "cpu" and (x.dtype is torch.bfloat16 or (x.dtype is torch.float32 and self.plan is not None
                                                                       and self.weight.dtype is torch.float32)):
            rows = x.numel() // self.in_features
            x2 = x.reshape(rows, self.in_features)
            if self.row_invariant and rows > MAX_INVARIANT_ROWS:
                y = torch.cat([self._run_rows(x2[i:i + MAX_INVARIANT_ROWS])
                               for i in range(0, rows, MAX_INVARIANT_ROWS)])
            else:
                y = self._run_rows(x2)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def _run_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """One kernel call on a 2-D input, padded to the row count it runs as (`rows_to_run`)."""
        rows = x2.shape[0]
        run = self.rows_to_run(rows)
        if run > rows:  # zero rows appended: a row count this host's kernel runs faster (tune_padding)
            x2 = torch.cat((x2, x2.new_zeros(run - rows, self.in_features)))
        y = self.run_kernel(self.kernel_for(run), x2)
        return y[:rows] if run > rows else y


def prepack_linears(model: nn.Module, rows_hint: int = 4) -> int:
    """`prepack` every `Linear` of an inference model; returns how many were packed (0 off a bf16 CPU, and where
    `packing_supported()` is False)."""
    settings.prepare_process()  # oneDNN's cache sizes, before the first packing
    return sum(m.prepack(rows_hint) for m in model.modules() if isinstance(m, Linear))


def _time_kernels(layer: Linear, rows: int, kernels: list[str], budget_s: float = 0.03) -> dict[str, float]:
    """Median seconds per call of each kernel on random rows, the kernels interleaved per repeat."""
    x = torch.randn(rows, layer.in_features).to(layer.weight.dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for k in kernels:  # warm-up (first-call allocations), and a cost estimate for the repeat count
            layer.run_kernel(k, x)
        per_round = max(time.perf_counter() - t0, 1e-6)
        reps = max(3, min(15, int(budget_s / per_round)))
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for _ in range(reps):
            for k in kernels:
                t = time.perf_counter()
                layer.run_kernel(k, x)
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def tune_plan(layer: Linear) -> tuple[str, ...]:
    """The fastest kernel per row class for this layer's shape, measured now (cached per shape and thread count)."""
    key = (type(layer).__name__, layer.out_features, layer.in_features, layer.bias is not None,
           torch.get_num_threads(), layer.row_invariant, layer.weight.dtype)
    if key not in _TUNED:
        plan = []
        for rows in ROW_CLASSES:
            cands = layer.kernels(rows)
            times = _time_kernels(layer, rows, cands) if len(cands) > 1 else {cands[0]: 0.0}
            plan.append(min(times, key=times.get))
        many = layer.kernels(ROW_CLASSES[-1] + 1)
        if "packed" in many:
            plan.append("packed")
        elif "stream" in many:  # a prefill chunk's worth of rows
            times = _time_kernels(layer, 4 * ROW_CLASSES[-1], ["gemm", "stream"])
            plan.append(min(times, key=times.get))
        else:
            plan.append("gemm")
        _TUNED[key] = tuple(plan)
    return _TUNED[key]


def _time_rows(layers: list[Linear], budget_s: float = 0.6) -> list[dict[int, float]]:
    """Seconds of one pass over `layers`, each on its plan's kernel, per row count 1..PAD_MAX_ROWS, one dict per
    repeat. A pass reads every layer's own weight once, so the weights stream from memory as they do in a forward;
    the row counts are interleaved within each repeat, so that drift between repeats cancels in their ratios."""
    first = layers[0]
    xs = {r: torch.randn(r, first.in_features).to(first.weight.dtype) for r in range(1, PAD_MAX_ROWS + 1)}

    def one_pass(r: int) -> float:
        t = time.perf_counter()
        for m in layers:
            m.run_kernel(m.kernel_for(r), xs[r])
        return time.perf_counter() - t

    with torch.inference_mode():
        per_round = sum(one_pass(r) for r in xs)  # warm-up, and a cost estimate for the repeat count
        reps = max(5, min(15, int(budget_s / max(per_round, 1e-6))))
        return [{r: one_pass(r) for r in xs} for _ in range(reps)]


def tune_padding(layers: list[Linear]) -> tuple[int, ...]:
    """`pad_to` for a group of same-shaped layers with the same plan: per row count r, the row count p >= r with
    the smallest median paired ratio t(p) / t(r), where that ratio is below 1 - PAD_MARGIN; else r (cached per
    shape, plan, threads and group size)."""
    m = layers[0]
    key = (type(m).__name__, m.out_features, m.in_features, m.bias is not None, torch.get_num_threads(),
           m.plan, len(layers), m.row_invariant, m.weight.dtype)
    if key not in _PADS:
        reps = _time_rows(layers)
        pad = []
        for r in range(1, PAD_MAX_ROWS + 1):
            low = r if not m.row_invariant or m.kernel_for(r) in ("gemv", "stream") else max(r, MIN_INVARIANT_ROWS)
            ratio = {p: statistics.median(t[p] / t[low] for t in reps) for p in range(low, PAD_MAX_ROWS + 1)}
            p = min(ratio, key=ratio.get)
            pad.append(p if ratio[p] < 1.0 - PAD_MARGIN else low)
        _PADS[key] = tuple(pad)
    return _PADS[key]


def tune_linears(model: nn.Module) -> dict[str, int]:
    """Give every bf16 CPU `Linear` of `model` (and fp32 one, where `stream_supported`) its measured plan and row
    padding (call where the model will run: both are per thread count). → how many layers took each plan, e.g.
    {"packed/packed/packed/packed": 211}. No tuning when it is off (SPECDEC_KERNEL_TUNE=0: each layer's
    `default_plan`), on other dtypes and devices. Row-invariant layers are checked either way
    (`check_row_invariance`; a warning names the shapes that fail)."""
    counts: dict[str, int] = {}
    groups: dict[tuple, list[Linear]] = {}
    stream = stream_supported()
    for m in model.modules() if tuning_enabled() else ():
        if not _tunable(m, stream):
            continue
        m.plan = tune_plan(m)
        name = "/".join(m.plan)
        counts[name] = counts.get(name, 0) + 1
        groups.setdefault((type(m), m.out_features, m.in_features, m.bias is not None, m.weight.dtype, m.plan),
                          []).append(m)
    for layers in groups.values():
        pad = tune_padding(layers)
        for m in layers:
            m.pad_to = pad if any(p > r for r, p in enumerate(pad, 1)) else None
    bad = enforce_row_invariance(model)
    release_stream_weights(model)
    if bad:
        log.warning("row-invariant linears %s round some rows differently alone than in a batch on this host: a "
                    "target's greedy output may depend on the load", bad)
    return counts


def release_stream_weights(model: nn.Module) -> int:
    """Drop the streaming kernel's packed copy (`Linear.stream_weight`, made while tuning timed it) from every `Linear`
    of `model` whose plan never runs `stream`; → how many were dropped. A layer that takes `stream` later packs
    again on its first call."""
    dropped = 0
    for m in model.modules():
        if isinstance(m, Linear) and m._streamed is not None and "stream" not in (m.plan or m.default_plan()):
            m._streamed, dropped = None, dropped + 1
    return dropped


def enforce_row_invariance(model: nn.Module) -> list[tuple[int, int]]:
    """Check the row-invariant layers. A shape that fails while one row runs on `torch.mv` moves one-row calls to
    the padded multi-row kernel; one that still fails where `stream` is a candidate moves to it for every row
    count, unpadded (it rounds every row alike by construction). Each step is checked again. → the shapes that
    still fail (none expected)."""
    bad = check_row_invariance(model)
    if not bad:
        return bad
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.row_invariant]
    for m in layers:
        if (m.out_features, m.in_features) in bad and m.kernel_for(1) == "gemv":
            m.plan = ("packed" if m._packed_weight() is not None else "gemm",) + tuple(m.plan or m.default_plan())[1:]
            if m.pad_to is not None and m.pad_to[0] < MIN_INVARIANT_ROWS:
                m.pad_to = (MIN_INVARIANT_ROWS,) + m.pad_to[1:]
    bad = check_row_invariance(model)
    moved = False
    for m in layers:
        if (m.out_features, m.in_features) in bad and "stream" in m.kernels(1):
            m.plan, m.pad_to, moved = STREAM_PLAN, None, True
    return check_row_invariance(model) if moved else bad


def set_row_invariant(model: nn.Module, on: bool = True) -> None:
    """Make every `Linear` of `model` row-invariant (the module docstring); call before `tune_linears`."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.row_invariant = on


def row_invariance_enabled() -> bool:
    """`specdec.common.settings` `row_invariant` (SPECDEC_ROW_INVARIANT)."""
    return settings.get().row_invariant


def check_row_invariance(model: nn.Module, max_rows: int = MAX_INVARIANT_ROWS + 8) -> list[tuple[int, int]]:
    """The (out_features, in_features) of the row-invariant bf16 CPU `Linear`s of `model` (and fp32 ones that run a
    plan: hosts where `stream_supported`) whose rows, on random inputs, differ between a call of one row and calls
    of 2..max_rows rows as they run now (plan and padding). Empty: every row of every such layer rounds alike
    whatever its call's row count."""
    bad, seen = [], set()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m in model.modules():
            if not (isinstance(m, Linear) and m.row_invariant and m.weight.device.type == "cpu"
                    and (m.weight.dtype is torch.bfloat16 or (m.weight.dtype is torch.float32
                                                              and m.plan is not None))):
                continue
            key = (m.out_features, m.in_features, m.weight.dtype, m.plan, m.pad_to)
            if key in seen:
                continue
            seen.add(key)
            x = torch.randn(max_rows, m.in_features, generator=gen).to(m.weight.dtype)
            alone = torch.cat([m(x[i:i + 1]) for i in range(max_rows)])
            if not all(torch.equal(m(x[:n]), alone[:n]) for n in range(2, max_rows + 1)):
                bad.append((m.out_features, m.in_features))
    return bad


def padding(model: nn.Module) -> dict[tuple[int, int], tuple[int, ...]]:
    """{(out_features, in_features): pad_to} of the padded bf16 `Linear`s of `model` (what tuning chose)."""
    return {(m.out_features, m.in_features): m.pad_to for m in model.modules()
            if isinstance(m, Linear) and m.pad_to is not None}


def set_padding(model: nn.Module, pad_to: tuple[int, ...] | None) -> None:
    """Fix every `Linear`'s row padding (None: unpadded); A/B measurements and tests."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.pad_to = pad_to


def set_plan(model: nn.Module, plan: tuple[str, ...] | None) -> None:
    """Fix every `Linear`'s plan (None: back to its DEFAULT_PLAN); A/B measurements and tests."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.plan = plan
