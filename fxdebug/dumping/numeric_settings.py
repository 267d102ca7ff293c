"""The process-wide settings that change what a model computes: recorded by dump, applied by run.py.

A float32 convolution gives other numbers with TF32 on than off, a matmul other
numbers with ``torch.set_float32_matmul_precision("medium")``, a ``torch.full``
another dtype under ``torch.set_default_dtype(torch.float64)``. ``dump`` records
these settings, as they were when ``expected.pt`` was computed, in the folder's
``settings.json``; ``run.py``, a process of its own, sets them again before it
loads the model (it carries a copy of these functions: they need only torch).
``load()`` imported into your own process sets nothing.

:data:`SETTINGS`, in the order they are applied (a whole before its parts:
setting ``torch.backends.fp32_precision`` sets the backends' under it, the
legacy TF32 flags set the ``fp32_precision`` ones), each read and set through
public torch API:

* ``torch.get_default_dtype()``; ``torch.use_deterministic_algorithms`` (and its ``warn_only``)
* TF32 and reduced precision: ``torch.get_float32_matmul_precision()``,
  ``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``,
  the ``fp32_precision`` of torch.backends and of its cuda, cudnn and mkldnn
  operators, ``torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction``
* which kernels run: ``torch.backends.cudnn.{enabled,benchmark,deterministic}``,
  ``torch.backends.mkldnn.{enabled,deterministic}``, the scaled-dot-product
  attention backends (``torch.backends.cuda.flash_sdp_enabled()``...)
* the environment variable ``CUBLAS_WORKSPACE_CONFIG`` (deterministic cuBLAS needs it)
* the environment variable ``MKL_CBWR`` (where torch has MKL): without it, MKL's threaded
  matrix products are not reproducible bit for bit, even at one thread count in one process
  (resnet18's convolution gradients at 1x3x32x32 with 2 threads on a busy 2-core machine:
  3 different results in 40 runs; with ``MKL_CBWR=AUTO``, or one thread, one). MKL reads it
  at its first computation: run.py sets it before it loads anything.
* on the CPU: ``torch.get_num_threads()`` (a CPU convolution or reduction splits its sum
  by thread: efficientnet_b0's output at 1x3x64x64 differs in its last bits between 1 and
  2 threads) and ``torch.backends.cpu.get_cpu_capability()`` (the vector instructions
  ATen's kernels use, chosen at start-up from the CPU or ``ATEN_CPU_CAPABILITY``: ``DEFAULT``
  gives other bits than ``AVX2``). The capability cannot be changed once torch runs:
  run.py reports it where it differs, with the variable that sets it.

Not recorded: ``torch.get_num_interop_threads()`` (tried: 1 or 2 inter-op threads give
the same bits, they only run independent ops side by side), ``torch.set_flush_denormal``
(torch has no way to read it). A name this torch lacks is left out when recording and
reported, not applied, by run.py.

>>> recorded = read_settings()
>>> recorded["torch.get_default_dtype()"], setting_text("torch.backends.cudnn.allow_tf32", False)
('torch.float32', 'torch.backends.cudnn.allow_tf32 = False')
"""

import os

import torch

__all__ = ["SETTINGS", "DETERMINISTIC", "SETTERS", "ENVIRONMENT", "MKL_REPRODUCIBILITY", "CPU_CAPABILITY",
           "resolve_torch_path",
           "read_setting", "write_setting", "read_settings", "setting_text", "apply_settings", "nondeterminism"]

DETERMINISTIC = "torch.are_deterministic_algorithms_enabled()"
"""Its value: True, False, or "warn_only" (``use_deterministic_algorithms(True, warn_only=True)``)."""

SETTINGS = (
    "torch.get_default_dtype()",
    DETERMINISTIC,
    "torch.get_float32_matmul_precision()",
    "torch.backends.cuda.matmul.allow_tf32",
    "torch.backends.cudnn.allow_tf32",
    "torch.backends.fp32_precision",
    "torch.backends.cuda.matmul.fp32_precision",
    "torch.backends.cudnn.fp32_precision",
    "torch.backends.cudnn.conv.fp32_precision",
    "torch.backends.cudnn.rnn.fp32_precision",
    "torch.backends.mkldnn.fp32_precision",
    "torch.backends.mkldnn.matmul.fp32_precision",
    "torch.backends.mkldnn.conv.fp32_precision",
    "torch.backends.mkldnn.rnn.fp32_precision",
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "torch.backends.cudnn.enabled",
    "torch.backends.cudnn.benchmark",
    "torch.backends.cudnn.deterministic",
    "torch.backends.mkldnn.enabled",
    "torch.backends.mkldnn.deterministic",
    "torch.backends.cuda.flash_sdp_enabled()",
    "torch.backends.cuda.mem_efficient_sdp_enabled()",
    "torch.backends.cuda.math_sdp_enabled()",
    "torch.backends.cuda.cudnn_sdp_enabled()",
    "torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()",
    "os.environ['CUBLAS_WORKSPACE_CONFIG']",
    "os.environ['MKL_CBWR']",
    "torch.get_num_threads()",
    "torch.backends.cpu.get_cpu_capability()",
)
"""Every setting recorded, named by the expression that reads it, in the order run.py applies them."""

SETTERS = {
    "torch.get_default_dtype()": "torch.set_default_dtype",
    DETERMINISTIC: "torch.use_deterministic_algorithms",
    "torch.get_float32_matmul_precision()": "torch.set_float32_matmul_precision",
    "torch.backends.cuda.flash_sdp_enabled()": "torch.backends.cuda.enable_flash_sdp",
    "torch.backends.cuda.mem_efficient_sdp_enabled()": "torch.backends.cuda.enable_mem_efficient_sdp",
    "torch.backends.cuda.math_sdp_enabled()": "torch.backends.cuda.enable_math_sdp",
    "torch.backends.cuda.cudnn_sdp_enabled()": "torch.backends.cuda.enable_cudnn_sdp",
    "torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()":
        "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp",
    "torch.get_num_threads()": "torch.set_num_threads",
}
"""The function that sets each setting read by a call (the others are attributes, set by assignment)."""

ENVIRONMENT = "os.environ['CUBLAS_WORKSPACE_CONFIG']"

MKL_REPRODUCIBILITY = "os.environ['MKL_CBWR']"
"""MKL's conditional numerical reproducibility (``AUTO``, ``AVX512``...): recorded only where torch has MKL."""

CPU_CAPABILITY = "torch.backends.cpu.get_cpu_capability()"
"""Read only: ATen picks it when torch starts, from the CPU or ``ATEN_CPU_CAPABILITY``."""


def resolve_torch_path(path):
    """``(owner, attribute name)`` of a dotted path under torch.

    >>> resolve_torch_path("torch.backends.cudnn.enabled") == (torch.backends.cudnn, "enabled")
    True
    """
    owner = torch
    parts = path.split(".")
    for part in parts[1:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


def read_setting(name):
    """The value of one of :data:`SETTINGS` now (a str, bool, int or None).

    Raises AttributeError where this torch lacks it, RuntimeError where torch
    refuses to read it (the legacy TF32 flags, after the fp32_precision ones were
    set to a mix they cannot express).

    >>> read_setting("torch.backends.cudnn.enabled"), read_setting(DETERMINISTIC)
    (True, False)
    """
    if name == ENVIRONMENT:
        return os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if name == MKL_REPRODUCIBILITY:
        if not torch.backends.mkl.is_available():
            raise AttributeError("this torch has no MKL")
        return os.environ.get("MKL_CBWR")
    if name == DETERMINISTIC:
        if not torch.are_deterministic_algorithms_enabled():
            return False
        return "warn_only" if torch.is_deterministic_algorithms_warn_only_enabled() else True
    if name.endswith("()"):
        owner, attr = resolve_torch_path(name[:-2])
        value = getattr(owner, attr)()
    else:
        owner, attr = resolve_torch_path(name)
        value = getattr(owner, attr)
    if isinstance(value, torch.dtype):
        return str(value)
    if not isinstance(value, (bool, str, int)) and value is not None:
        raise AttributeError(f"{name} reads {type(value).__name__}, not a flag")
    return value


def write_setting(name, value):
    """Set one of :data:`SETTINGS` to ``value`` (as :func:`read_setting` gave it).

    >>> before = read_setting("torch.backends.cudnn.benchmark")
    >>> write_setting("torch.backends.cudnn.benchmark", True)
    >>> read_setting("torch.backends.cudnn.benchmark")
    True
    >>> write_setting("torch.backends.cudnn.benchmark", before)
    """
    if name == ENVIRONMENT:
        if value is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = value
    elif name == MKL_REPRODUCIBILITY:
        if not torch.backends.mkl.is_available():
            raise AttributeError("this torch has no MKL")
        if value is None:
            os.environ.pop("MKL_CBWR", None)
        else:
            os.environ["MKL_CBWR"] = value
    elif name == CPU_CAPABILITY:
        raise RuntimeError(f"this process runs {read_setting(name)}: torch picks it when it starts, "
                           f"set the variable before python starts")
    elif name == DETERMINISTIC:
        torch.use_deterministic_algorithms(value is not False, warn_only=value == "warn_only")
    elif name in SETTERS:
        owner, attr = resolve_torch_path(SETTERS[name])
        if name == "torch.get_default_dtype()":
            value = getattr(torch, value.split(".")[-1])
        getattr(owner, attr)(value)
    else:
        owner, attr = resolve_torch_path(name)
        setattr(owner, attr, value)


def read_settings():
    """``{name: value}`` of every setting of :data:`SETTINGS` this torch can read now.

    >>> "torch.backends.cudnn.allow_tf32" in read_settings()
    True
    """
    values = {}
    for name in SETTINGS:
        try:
            values[name] = read_setting(name)
        except (AttributeError, RuntimeError):  # not in this torch, or not readable now: not recorded
            continue
    return values


def setting_text(name, value):
    """How one setting reads in run.py's output: the statement that sets it.

    >>> setting_text("torch.get_float32_matmul_precision()", "medium")
    "torch.set_float32_matmul_precision('medium')"
    >>> setting_text(DETERMINISTIC, "warn_only")
    'torch.use_deterministic_algorithms(True, warn_only=True)'
    >>> setting_text("torch.get_num_threads()", 2), setting_text(CPU_CAPABILITY, "AVX2")
    ('torch.set_num_threads(2)', 'ATEN_CPU_CAPABILITY=avx2')
    >>> setting_text(MKL_REPRODUCIBILITY, "AUTO"), setting_text(MKL_REPRODUCIBILITY, None)
    ('MKL_CBWR=AUTO', 'no MKL_CBWR')
    """
    if name == ENVIRONMENT:
        return f"CUBLAS_WORKSPACE_CONFIG={value}" if value is not None else "no CUBLAS_WORKSPACE_CONFIG"
    if name == MKL_REPRODUCIBILITY:
        return f"MKL_CBWR={value}" if value is not None else "no MKL_CBWR"
    if name == CPU_CAPABILITY:
        return f"ATEN_CPU_CAPABILITY={str(value).lower()}"
    if name == DETERMINISTIC:
        return f"torch.use_deterministic_algorithms({value is not False}" + (
            ", warn_only=True)" if value == "warn_only" else ")")
    if name == "torch.get_default_dtype()":
        return f"torch.set_default_dtype({value})"
    if name in SETTERS:
        return f"{SETTERS[name]}({value!r})"
    return f"{name} = {value!r}"


def apply_settings(recorded):
    """Set each of ``recorded`` (``{name: value}``) that differs now; ``(applied, failed)`` texts.

    In the order of ``recorded`` (that of :data:`SETTINGS`), each only where it
    reads otherwise now, so a legacy flag set first leaves the fp32_precision
    ones it implies alone; then every one is read again: ``failed`` says which
    do not read as recorded (this torch lacks it, refuses it, or a later one
    undid it).

    >>> before = read_settings()
    >>> apply_settings({"torch.backends.cudnn.benchmark": True, "torch.backends.no_such_flag": True})
    (['torch.backends.cudnn.benchmark = True'], ['torch.backends.no_such_flag = True (this torch lacks it)'])
    >>> apply_settings(before)[0]
    ['torch.backends.cudnn.benchmark = False']
    """
    applied, failed = [], {}
    for name, value in recorded.items():
        try:
            if read_setting(name) == value:
                continue
            write_setting(name, value)
        except (AttributeError, KeyError):
            failed[name] = "this torch lacks it"
        except (RuntimeError, TypeError, ValueError) as exc:
            failed[name] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        else:
            applied.append(setting_text(name, value))
    for name, value in recorded.items():
        if name not in failed:
            try:
                now = read_setting(name)
            except (AttributeError, RuntimeError) as exc:
                now = f"unreadable: {exc}"
            if now != value:
                failed[name] = f"reads {now!r}"
    return applied, [f"{setting_text(name, recorded[name])} ({why})" for name, why in failed.items()]


def nondeterminism(settings, devices):
    """Why torch does not promise the same bits twice for a run on ``devices`` under ``settings``.

    On CUDA: without ``torch.use_deterministic_algorithms(True)`` (or only
    warn-only), or with ``torch.backends.cudnn.benchmark``: what torch's
    reproducibility notes ask for. On the CPU, where torch has MKL (``MKL_CBWR``
    recorded): more than one thread without ``MKL_CBWR``. ``""`` otherwise.

    >>> nondeterminism({DETERMINISTIC: False, "torch.backends.cudnn.benchmark": False}, ["cuda"])
    'the dump ran on CUDA without torch.use_deterministic_algorithms(True)'
    >>> nondeterminism({DETERMINISTIC: False, "torch.get_num_threads()": 1, MKL_REPRODUCIBILITY: None}, ["cpu"])
    ''
    >>> nondeterminism({"torch.get_num_threads()": 2, MKL_REPRODUCIBILITY: "AUTO"}, ["cpu"])
    ''
    >>> print(nondeterminism({"torch.get_num_threads()": 2, MKL_REPRODUCIBILITY: None}, ["cpu"]))
    the dump ran on the CPU with 2 threads without MKL_CBWR (MKL's threaded matrix products, convolutions' too, give other last bits from run to run; MKL_CBWR=AUTO or one thread gives the same bits)
    """
    found = []
    if "cuda" in devices:
        reasons = []
        if settings.get(DETERMINISTIC) is not True:
            reasons.append("without torch.use_deterministic_algorithms(True)" if settings.get(DETERMINISTIC) is False
                           else "with torch.use_deterministic_algorithms(True, warn_only=True)")
        if settings.get("torch.backends.cudnn.benchmark"):
            reasons.append("with torch.backends.cudnn.benchmark = True (kernels picked by timing)")
        if reasons:
            found.append("the dump ran on CUDA " + " and ".join(reasons))
    threads = settings.get("torch.get_num_threads()") or 1
    if "cpu" in devices and threads > 1 and MKL_REPRODUCIBILITY in settings and settings[MKL_REPRODUCIBILITY] is None:
        found.append(f"the dump ran on the CPU with {threads} threads without MKL_CBWR (MKL's threaded "
                     f"matrix products, convolutions' too, give other last bits from run to run; "
                     f"MKL_CBWR=AUTO or one thread gives the same bits)")
    return "; ".join(found)
