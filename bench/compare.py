#!/usr/bin/env python3
"""Times dsv4's sparse decode attention and decode indexer beside FlashMLA's sparse decode and
DeepGEMM's fp8_paged_mqa_logits at the same shapes, and prints one markdown table per comparison
for bench/RESULTS.md.

Our side runs through the command line (`dsv4 bench --op attention-decode|indexer|index-topk`,
each in the v4.1-native formats and in fp8_ds_mla rows: 584-byte attention rows and 132-byte FP8
index keys, the rows FlashMLA and DeepGEMM read). Their side is timed in this process, after ours,
when `import flash_mla` / `import deep_gemm` works (installed, or a source tree the user built
with the project's own setup, given by --flashmla-src / --deepgemm-src); this script builds
nothing and holds no third-party code. It times them as `dsv4 bench` times ours: one call
captured in a CUDA graph, --warmup untimed replays, then --iters replays each between its own
pair of CUDA events, median (plain launches between events if the capture fails; the table says
which). Without them it compares with the figures measured on the same H200 kind in
../shared/FLASHMLA_BASELINE.md (a document outside the repository; the numbers are copied below).

Plain Python 3 (standard library); torch only to time FlashMLA / DeepGEMM.
  python3 bench/compare.py [--dsv4 build/dsv4] [--only attention|indexer]
  python3 bench/compare.py --from-log saved_bench_output.txt   # parse saved dsv4 bench output
"""
import argparse
import dataclasses
import datetime
import math
import os
import re
import subprocess
import sys

# --- The shapes (FLASHMLA_BASELINE.md §3 and §6) ----------------------------------------------

HEADS, HEAD_DIM = 64, 512       # query heads x d_qk (448 fp8 NoPE + 64 bf16 RoPE) = d_v
WINDOW_ROWS, PICKS = 128, 512   # SWA top-k (consecutive positions) + compressed ("extra") top-k
COMPRESSED_TOKENS = 32768       # compressed tokens per request the picks are drawn from
ATTENTION_BATCHES = (1, 64, 128, 256)
INDEX_HEADS, INDEX_DIM = 32, 128
INDEX_BATCH = 64
INDEX_CONTEXTS = (32768, 131072)  # compressed keys per request
FORMAT_SETS = ("v4.1-native", "fp8_ds_mla")  # dsv4 bench --kv-format: native rows, then FlashMLA's / DeepGEMM's

# --- Their figures: ../shared/FLASHMLA_BASELINE.md, measured 2026-11-29 on one H200 ------------
# (FlashMLA 9241ae3, DeepGEMM 54e2261). FlashMLA: the "graph" column of §5 (s_q 1, MODEL1 584 B rows,
# back-to-back graph replays over input sets that touch > 3x L2). DeepGEMM: the "b2b" column of §6
# (32 heads x 128, next_n 1, batch 64, 132 B FP8 keys, logits only, back-to-back calls).
BASELINE_SOURCE = "FLASHMLA_BASELINE.md 2026-11-29"
FLASHMLA_BASELINE_US = {1: 13.1, 64: 44.7, 128: 46.9, 256: 87.6}
DEEPGEMM_BASELINE_US = {32768: 72.1, 131072: 276.9}
MEASURED_NOW = "measured now"


# --- dsv4 bench output (bench/timing.cpp print_result) ------------------------------------------

@dataclasses.dataclass
class BenchRecord:
    """One result block of `dsv4 bench`."""
    op: str
    batch: int
    context: int
    workload: str = ""
    kernel: str = ""
    median_us: float = math.nan
    gb_per_s: float = math.nan  # the bytes dsv4 bench counts for the op / median

    def attention_formats(self):
        """(window format, compressed format) of an attention op, or None."""
        m = re.search(r"window \d+ \((\w+)\) \+ \d+ picks \((\w+)\)", self.workload)
        return (m.group(1), m.group(2)) if m else None

    def steady_state(self):
        """Whether the record is attention-decode's steady state (many calls per graph, FLASHMLA_BASELINE's method)."""
        return "steady state" in self.workload

    def index_keys(self):
        """(key format, bytes per key) of an indexer op, or None."""
        m = re.search(r"(\w+) keys \((\d+) B/row\)", self.workload)
        return (m.group(1), int(m.group(2))) if m else None

    def scores(self):
        """'fp32' or 'bf16-rounded' for indexer ops."""
        m = re.search(r"([\w-]+) scores", self.workload)
        return m.group(1) if m else ""


HEADER = re.compile(r"^dsv4 bench: op (\S+), preset \S+ \(.*\), batch (\d+), context (\d+)\s*$")
FIELDS = [  # (pattern, store into the current record)
    (re.compile(r"^\s+workload\s+(.*?)\s*$"), lambda r, m: setattr(r, "workload", m.group(1))),
    (re.compile(r"^\s+kernel\s+(.*?)\s*$"), lambda r, m: setattr(r, "kernel", m.group(1))),
    (re.compile(r"^\s+time\s+median ([\d.]+) us"), lambda r, m: setattr(r, "median_us", float(m.group(1)))),
    (re.compile(r"^\s+memory\s.*-> ([\d.]+) GB/s"), lambda r, m: setattr(r, "gb_per_s", float(m.group(1)))),
]


def parse_bench_output(text):
    """The result blocks of (concatenated) `dsv4 bench` output, in order; other lines are skipped."""
    records = []
    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            records.append(BenchRecord(m.group(1), int(m.group(2)), int(m.group(3))))
            continue
        if not records:
            continue
        for pattern, store in FIELDS:
            m = pattern.match(line)
            if m:
                store(records[-1], m)
                break
    return [r for r in records if not math.isnan(r.median_us)]


# --- What we run -------------------------------------------------------------------------------

def attention_commands(dsv4):
    return [[dsv4, "bench", "--op", "attention-decode", "--batch", str(b), "--context", str(COMPRESSED_TOKENS),
             "--kv-format", f] for b in ATTENTION_BATCHES for f in FORMAT_SETS]


def indexer_commands(dsv4):
    return [[dsv4, "bench", "--op", op, "--batch", str(INDEX_BATCH), "--context", str(ctx), "--kv-format", f]
            for ctx in INDEX_CONTEXTS for op in ("indexer", "index-topk") for f in FORMAT_SETS]


def run_commands(commands, iters, warmup, log):
    """Runs our benches; returns their concatenated output (a failing command is reported and skipped)."""
    out = []
    for cmd in commands:
        cmd = cmd + ["--iters", str(iters), "--warmup", str(warmup)]
        print("running:", " ".join(cmd), file=sys.stderr, flush=True)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            sys.exit(f"compare: cannot run {cmd[0]}: {e} (build dsv4 with -DDSV4_CUDA=ON, or give --dsv4 PATH)")
        if p.returncode != 0:
            print(f"compare: {' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr.strip()}", file=sys.stderr)
        out.append(p.stdout)
        if log:
            log.write(p.stdout)
            log.flush()
    return "".join(out)


def find_record(records, op, batch, context, predicate):
    """The last record of `op` at (batch, context) that `predicate` accepts, or None."""
    found = [r for r in records if r.op == op and r.batch == batch and r.context == context and predicate(r)]
    return found[-1] if found else None


# --- Their side ------------------------------------------------------------------------------

def percentile(values, q):
    """As bench/timing.cpp: linear interpolation between the sorted values."""
    v = sorted(values)
    at = q * (len(v) - 1)
    lo, hi = math.floor(at), math.ceil(at)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


def time_like_dsv4_bench(torch, call, iters, warmup):
    """Microseconds of `call` timed as `dsv4 bench` times ours: captured once in a CUDA graph, `warmup`
    replays, then `iters` replays each between its own pair of events. Returns (us list, method)."""
    call()  # outside the capture: one-time work (JIT, scheduling metadata, lazy loading)
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        launch, method = graph.replay, "CUDA graph replays"
    except Exception as e:  # the library's call is not capturable: time plain launches and say so
        torch.cuda.synchronize()
        launch, method = call, f"plain launches between events (graph capture failed: {type(e).__name__})"
    for _ in range(warmup):
        launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        launch()
        end.record()
    torch.cuda.synchronize()
    return [1000.0 * start.elapsed_time(end) for start, end in events], method


def random_e4m3_bytes(torch, shape):
    """Bytes of finite e4m3 values of either sign (0x7f / 0xff are NaN)."""
    magnitude = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device="cuda")
    return magnitude | (torch.randint(0, 2, shape, dtype=torch.uint8, device="cuda") << 7)


def model1_cache(torch, num_pages, page_size):
    """A FlashMLA MODEL1 fp8 cache (FLASHMLA_BASELINE.md §3): inside a page, every token's 448 e4m3
    + 64 bf16 RoPE values (576 B) first, then 8 B of UE8M0 scales per token (7 used), the page
    padded to a multiple of 576 B; viewed as [pages, page_size, 1, 584] e4m3."""
    data, row = 576, 584
    page_bytes = (page_size * row + 575) // 576 * 576
    pages = random_e4m3_bytes(torch, (num_pages, page_bytes))
    values = pages[:, :page_size * data].view(num_pages, page_size, data)
    values[:, :, 448:].view(torch.bfloat16).copy_(
        torch.randn(num_pages, page_size, 64, device="cuda", dtype=torch.bfloat16))
    scales = pages[:, page_size * data:page_size * row].view(num_pages, page_size, 8)
    scales[:, :, :7] = torch.randint(120, 125, (num_pages, page_size, 7), dtype=torch.uint8, device="cuda")
    scales[:, :, 7] = 0
    return pages[:, :page_size * row].view(torch.float8_e4m3fn).view(num_pages, page_size, 1, row)


def time_flashmla(flash_mla, torch, batch, iters, warmup):
    """FlashMLA's sparse decode at the baseline's shapes: s_q 1, 64 heads, SWA 128 consecutive rows
    in pages of 256 + 512 distinct random picks of 32768 compressed rows in pages of 64 scattered
    over the pool, MODEL1 rows for both, sink on."""
    torch.manual_seed(batch)
    swa_pages, swa_page = max(4096, 2 * batch), 256
    cmp_page = 64
    cmp_per_request = COMPRESSED_TOKENS // cmp_page
    cmp_pages = max(batch, 128) * cmp_per_request
    swa_cache = model1_cache(torch, swa_pages, swa_page)
    cmp_cache = model1_cache(torch, cmp_pages, cmp_page)
    # SWA: 128 consecutive positions from a random start inside the request's two pages.
    swa_table = torch.randperm(swa_pages, device="cuda")[:2 * batch].view(batch, 2)
    start = torch.randint(0, 2 * swa_page - WINDOW_ROWS + 1, (batch, 1), device="cuda")
    pos = start + torch.arange(WINDOW_ROWS, device="cuda")
    swa_idx = swa_table.gather(1, pos // swa_page) * swa_page + pos % swa_page
    # Compressed: 512 distinct random positions, unsorted, through the request's scattered pages.
    cmp_table = torch.randperm(cmp_pages, device="cuda")[:batch * cmp_per_request].view(batch, cmp_per_request)
    pos = torch.rand(batch, COMPRESSED_TOKENS, device="cuda").argsort(dim=1)[:, :PICKS]
    cmp_idx = cmp_table.gather(1, pos // cmp_page) * cmp_page + pos % cmp_page
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).clamp(-1, 1)
    sink = torch.randn(HEADS, device="cuda", dtype=torch.float32)
    sched, _ = flash_mla.get_mla_metadata()
    swa_idx = swa_idx.to(torch.int32).view(batch, 1, WINDOW_ROWS)
    cmp_idx = cmp_idx.to(torch.int32).view(batch, 1, PICKS)

    def call():
        return flash_mla.flash_mla_with_kvcache(
            q, swa_cache, None, None, HEAD_DIM, sched, None, softmax_scale=HEAD_DIM ** -0.5, causal=False,
            is_fp8_kvcache=True, indices=swa_idx, attn_sink=sink, extra_k_cache=cmp_cache,
            extra_indices_in_kvcache=cmp_idx)

    out, _ = call()
    torch.cuda.synchronize()
    if not torch.isfinite(out.float()).all():
        print(f"compare: FlashMLA batch {batch}: the output is not finite (timed anyway)", file=sys.stderr)
    return time_like_dsv4_bench(torch, call, iters, warmup)


def time_deepgemm(deep_gemm, torch, context, iters, warmup):
    """DeepGEMM's fp8_paged_mqa_logits at the baseline's shapes: batch 64, next_n 1, 32 heads x 128,
    `context` 132-byte FP8 keys per request (pages of 64, scattered), 2-D context lengths, FP32
    logits, no cleaning; the scheduling metadata is made once, outside the timing."""
    torch.manual_seed(context)
    block_kv = 64
    per_request = context // block_kv
    num_blocks = INDEX_BATCH * per_request
    row = INDEX_DIM + 4  # e4m3 key + fp32 scale
    cache = random_e4m3_bytes(torch, (num_blocks, block_kv * row))
    cache[:, block_kv * INDEX_DIM:].view(torch.float32).fill_(2.0 ** -4)
    kv_cache = cache.view(num_blocks, block_kv, 1, row)
    block_table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(INDEX_BATCH, per_request)
    q = torch.randn(INDEX_BATCH, 1, INDEX_HEADS, INDEX_DIM, device="cuda").to(torch.float8_e4m3fn)
    weights = torch.randn(INDEX_BATCH, INDEX_HEADS, device="cuda", dtype=torch.float32)
    context_lens = torch.full((INDEX_BATCH, 1), context, device="cuda", dtype=torch.int32)
    try:  # newer DeepGEMM takes the page size
        meta = deep_gemm.get_paged_mqa_logits_metadata(context_lens, block_kv, deep_gemm.get_num_sms())
    except TypeError:
        meta = deep_gemm.get_paged_mqa_logits_metadata(context_lens, deep_gemm.get_num_sms())

    def call():
        return deep_gemm.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, meta, context,
                                              clean_logits=False)

    return time_like_dsv4_bench(torch, call, iters, warmup)


def import_third_party(name, src):
    """(module `name`, torch), with `src` (a source tree built in place) first on sys.path; (None, None)
    when either is missing or there is no CUDA device, saying why."""
    if src:
        sys.path.insert(0, os.path.abspath(src))
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
        return __import__(name), torch
    except Exception as e:  # missing, or built for another torch / CUDA: compare with the baseline
        print(f"compare: {name} not usable ({type(e).__name__}: {e}); comparing with {BASELINE_SOURCE}",
              file=sys.stderr)
        return None, None


def measure_or_baseline(what, shapes, time_one, baseline):
    """shape -> (median us, source, method): timed by time_one(shape) -> (us list, method), or, where that
    fails, the baseline figure."""
    theirs = {}
    for shape in shapes:
        try:
            times, method = time_one(shape)
            theirs[shape] = (percentile(times, 0.5), MEASURED_NOW, method)
        except Exception as e:
            print(f"compare: {what} at {shape} failed ({type(e).__name__}: {e}); using {BASELINE_SOURCE}",
                  file=sys.stderr)
            theirs[shape] = (baseline[shape], BASELINE_SOURCE, None)
    return theirs


# --- Tables ----------------------------------------------------------------------------------

def us(v):
    """A time (or rate) with one decimal; — when missing."""
    return "—" if v is None or math.isnan(v) else f"{v:.1f}"


def ratio(theirs, ours):
    return "—" if ours is None or theirs is None or math.isnan(ours) or math.isnan(theirs) else f"{theirs / ours:.2f}×"


def table(title, theirs_name, rows, notes):
    """rows: (shape, dsv4 record or None, their us, source). The ratio is theirs / ours: above 1, dsv4 is faster."""
    lines = [f"### {title}", "",
             f"| shape | dsv4 kernel | dsv4 µs | dsv4 GB/s | {theirs_name} µs | {theirs_name} / dsv4 | "
             f"{theirs_name} source |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for shape, r, theirs, source in rows:
        ours = r.median_us if r else None
        lines.append(f"| {shape} | {r.kernel if r and r.kernel else '—'} | {us(ours)} | "
                     f"{us(r.gb_per_s if r else None)} | {us(theirs)} | {ratio(theirs, ours)} | {source} |")
    lines.append("")
    lines += [f"* {n}" for n in notes]
    lines.append(f"* {theirs_name} / dsv4 is the ratio of the times: above 1, dsv4 is faster. dsv4 GB/s counts the "
                 "bytes `dsv4 bench` names for the op.")
    return "\n".join(lines) + "\n"


def attention_table(records, theirs, iters, warmup):
    """theirs: batch -> (us, source, method)."""
    rows, methods = [], set()
    for b in ATTENTION_BATCHES:
        t_us, source, method = theirs.get(b, (None, "—", None))
        if method:
            methods.add(method)
        for f in FORMAT_SETS:
            want = ("fp8_ds_mla", "fp8_ds_mla") if f == "fp8_ds_mla" else ("v41_fp8", "v41_fp4")
            # The baseline's figures are its "graph" method (many calls per graph on their own inputs): our
            # steady state; FlashMLA timed here runs as our single call per graph replay.
            steady = method is None
            r = find_record(records, "attention-decode", b, COMPRESSED_TOKENS,
                            lambda r: r.attention_formats() == want and r.steady_state() == steady)
            rows_name = ("fp8_ds_mla rows (584 B, as FlashMLA)" if f == "fp8_ds_mla"
                         else "native rows (v41_fp8 528 B + v41_fp4 288 B)")
            rows.append((f"b {b}, dsv4 {rows_name}", r, t_us, source))
    notes = [f"{HEADS} heads × {HEAD_DIM}, one decode token per sequence, window {WINDOW_ROWS} + {PICKS} picks of "
             f"{COMPRESSED_TOKENS} compressed rows, sink; FlashMLA reads MODEL1 584-byte rows for both caches "
             "(SWA pages of 256, compressed pages of 64, sm90 sparse kernel + combine).",
             f"dsv4: `dsv4 bench --op attention-decode --batch B --context {COMPRESSED_TOKENS} --kv-format F` "
             f"(graph replays, median; the picks are ratio-1 entries of a {COMPRESSED_TOKENS}-row cache, pages of "
             "64 rows, 32 for v41_fp8). Against FlashMLA timed in this run: one call per graph replay on both sides; "
             "against the baseline's figures: our steady state, the baseline's own method (many calls per graph, "
             "each on its own inputs, together more than 3x the L2; time per call)."]
    sources = {source for _, source, _ in theirs.values()}
    if MEASURED_NOW in sources:
        notes.append(f"FlashMLA measured now in this run, the same way: {', '.join(sorted(methods))}, one input set "
                     f"replayed, median of {iters} after {warmup} warm-up.")
    if BASELINE_SOURCE in sources:
        notes.append("FlashMLA from FLASHMLA_BASELINE.md §5, \"graph\" column: replays of R calls on R input sets "
                     "that touch more than 3× the L2, time / R. dsv4 bench replays one input set, so at small "
                     "batches its rows may be served from the 60 MiB L2 (64 × 640 × 584 B = 24 MB): the ratio "
                     "flatters dsv4 there; measure FlashMLA in the same run for a like-for-like figure.")
    return table("Sparse decode attention: dsv4 vs FlashMLA (H200)", "FlashMLA", rows, notes)


def indexer_table(records, theirs, iters, warmup):
    """theirs: context -> (us, source, method)."""
    rows, methods = [], set()
    for ctx in INDEX_CONTEXTS:
        t_us, source, method = theirs.get(ctx, (None, "—", None))
        if method:
            methods.add(method)
        for op in ("indexer", "index-topk"):
            for keys in ("index_mxfp4", "index_fp8"):
                for scores in ("fp32", "bf16-rounded"):
                    r = find_record(records, op, INDEX_BATCH, ctx,
                                    lambda r: r.index_keys() is not None and r.index_keys()[0] == keys and r.scores() == scores)
                    key_bytes = r.index_keys()[1] if r else {"index_mxfp4": 68, "index_fp8": 132}[keys]
                    what = "scores" if op == "indexer" else "scores + top-512 (DeepGEMM: logits only)"
                    rows.append((f"b {INDEX_BATCH} × {ctx} keys, dsv4 {keys} ({key_bytes} B), {scores} {what}", r,
                                 t_us, source))
    notes = [f"{INDEX_HEADS} index heads × {INDEX_DIM}, one decode token per sequence against every key; DeepGEMM "
             "reads 132-byte FP8 keys (e4m3 + fp32 scale, pages of 64) and writes FP32 logits; it has no top-k.",
             f"dsv4: `dsv4 bench --op indexer|index-topk --batch {INDEX_BATCH} --context C --kv-format F` "
             "(v4.1-native: index_mxfp4 keys, fp8_ds_mla: index_fp8 keys; FP4 queries; graph replays, median)."]
    sources = {source for _, source, _ in theirs.values()}
    if MEASURED_NOW in sources:
        notes.append(f"DeepGEMM measured now in this run, the same way: {', '.join(sorted(methods))}, median of "
                     f"{iters} after {warmup} warm-up; its scheduling metadata made once, outside the timing.")
    if BASELINE_SOURCE in sources:
        notes.append("DeepGEMM from FLASHMLA_BASELINE.md §6, \"b2b\" column (back-to-back calls; its metadata "
                     "kernel, 5.8 µs, not included). The keys of one call (64 × 32768 × 68 B = 143 MB at "
                     "least) exceed the L2 on both sides.")
    return table("Decode indexer: dsv4 vs DeepGEMM fp8_paged_mqa_logits (H200)", "DeepGEMM", rows, notes)


# --- Main ------------------------------------------------------------------------------------

def theirs_attention(args, measure):
    flash_mla, torch = import_third_party("flash_mla", args.flashmla_src) if measure else (None, None)
    if flash_mla is None:
        return {b: (FLASHMLA_BASELINE_US[b], BASELINE_SOURCE, None) for b in ATTENTION_BATCHES}

    def time_one(b):
        try:
            return time_flashmla(flash_mla, torch, b, args.iters, args.warmup)
        finally:
            torch.cuda.empty_cache()

    return measure_or_baseline("FlashMLA", ATTENTION_BATCHES, time_one, FLASHMLA_BASELINE_US)


def theirs_indexer(args, measure):
    deep_gemm, torch = import_third_party("deep_gemm", args.deepgemm_src) if measure else (None, None)
    if deep_gemm is None:
        return {c: (DEEPGEMM_BASELINE_US[c], BASELINE_SOURCE, None) for c in INDEX_CONTEXTS}

    def time_one(c):
        try:
            return time_deepgemm(deep_gemm, torch, c, args.iters, args.warmup)
        finally:
            torch.cuda.empty_cache()

    return measure_or_baseline("DeepGEMM", INDEX_CONTEXTS, time_one, DEEPGEMM_BASELINE_US)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsv4", default="./build/dsv4", help="the dsv4 binary (default: %(default)s)")
    ap.add_argument("--only", choices=("attention", "indexer"), help="one comparison only")
    ap.add_argument("--from-log", metavar="FILE",
                    help="parse saved `dsv4 bench` output instead of running it (their side: the baseline figures)")
    ap.add_argument("--save-log", metavar="FILE", help="also write our benches' output here (for --from-log)")
    ap.add_argument("--flashmla-src", metavar="PATH", help="a FlashMLA source tree built in place by its own setup")
    ap.add_argument("--deepgemm-src", metavar="PATH", help="a DeepGEMM source tree built in place by its own setup")
    ap.add_argument("--baseline", action="store_true", help="compare with the baseline figures even when "
                    "FlashMLA / DeepGEMM can be imported")
    ap.add_argument("--iters", type=int, default=50, help="timed runs, both sides (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs before them (default: %(default)s)")
    args = ap.parse_args(argv)
    do_attention, do_indexer = args.only in (None, "attention"), args.only in (None, "indexer")

    if args.from_log:
        with open(args.from_log, encoding="utf-8") as f:
            records = parse_bench_output(f.read())
    else:
        commands = (attention_commands(args.dsv4) if do_attention else []) + \
                   (indexer_commands(args.dsv4) if do_indexer else [])
        log = open(args.save_log, "w", encoding="utf-8") if args.save_log else None
        try:
            records = parse_bench_output(run_commands(commands, args.iters, args.warmup, log))
        finally:
            if log:
                log.close()
    # Theirs in this run only beside ours of this run.
    measure = not args.from_log and not args.baseline

    print(f"<!-- bench/compare.py, {datetime.date.today().isoformat()}: "
          f"{len(records)} dsv4 bench results{' from ' + args.from_log if args.from_log else ''} -->\n")
    if do_attention:
        print(attention_table(records, theirs_attention(args, measure), args.iters, args.warmup))
    if do_indexer:
        print(indexer_table(records, theirs_indexer(args, measure), args.iters, args.warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
