"""Names shared by the three homes of the attention ops: backends, activations, the input error.

Kept free of torch and triton so that the dispatcher, the reference and the Triton file agree on
one spelling of each choice, and so that an error can be raised before anything heavy is imported.
"""

from __future__ import annotations

import enum
import time


class JaggedInputError(ValueError):
    """A jagged attention input is malformed: the message names the argument, the numbers and the fix."""


class Backend(str, enum.Enum):
    """Which implementation runs an op.

    ``AUTO`` picks ``TRITON`` for CUDA tensors and ``REFERENCE`` otherwise. ``FLEX`` (PyTorch's
    FlexAttention with a document mask) exists for softmax only: it cannot express an
    unnormalised activation.
    """

    AUTO = "auto"
    TRITON = "triton"
    REFERENCE = "reference"
    FLEX = "flex"


class Activation(str, enum.Enum):
    """The elementwise function that replaces softmax in GDPA.

    Every member maps 0 to 0; the Triton kernels rely on that to zero-fill rows and keys outside a
    sample instead of masking them on every tile.
    """

    IDENTITY = "identity"
    RELU = "relu"
    RELU_SQUARED = "relu_squared"
    SILU = "silu"
    GELU_TANH = "gelu_tanh"

    @property
    def code(self) -> int:
        """The integer the Triton kernels branch on at compile time."""
        return _ACTIVATION_CODES[self]


_ACTIVATION_CODES = {
    Activation.IDENTITY: 0,
    Activation.RELU: 1,
    Activation.RELU_SQUARED: 2,
    Activation.SILU: 3,
    Activation.GELU_TANH: 4,
}

# Spellings callers use elsewhere (PyTorch's `gelu(approximate="tanh")`, papers' "ReLU^2").
_ACTIVATION_ALIASES = {
    "gelu": Activation.GELU_TANH,
    "gelu_tanh": Activation.GELU_TANH,
    "relu2": Activation.RELU_SQUARED,
    "relu_squared": Activation.RELU_SQUARED,
    "relu^2": Activation.RELU_SQUARED,
    "squared_relu": Activation.RELU_SQUARED,
    "none": Activation.IDENTITY,
    "linear": Activation.IDENTITY,
}


# Exact spellings, looked up before any string work: parsing runs on every call.
_ACTIVATION_SPELLINGS = {**{a.value: a for a in Activation}, **_ACTIVATION_ALIASES}
_BACKEND_SPELLINGS = {b.value: b for b in Backend}


def parse_activation(value: str | Activation) -> Activation:
    """``value`` as an :class:`Activation`, or a :class:`JaggedInputError` listing the choices."""
    if isinstance(value, Activation):
        return value
    hit = _ACTIVATION_SPELLINGS.get(value) if type(value) is str else None
    if hit is not None:
        return hit
    key = str(value).lower()
    try:
        return _ACTIVATION_ALIASES.get(key) or Activation(key)
    except ValueError:
        choices = ", ".join(repr(a.value) for a in Activation)
        raise JaggedInputError(f"activation={value!r} is not supported; choose one of {choices}") from None


def parse_backend(value: str | Backend) -> Backend:
    """``value`` as a :class:`Backend`, or a :class:`JaggedInputError` listing the choices."""
    if isinstance(value, Backend):
        return value
    hit = _BACKEND_SPELLINGS.get(value) if type(value) is str else None
    if hit is not None:
        return hit
    try:
        return Backend(str(value).lower())
    except ValueError:
        choices = ", ".join(repr(b.value) for b in Backend)
        raise JaggedInputError(f"backend={value!r} is not a backend; choose one of {choices}") from None


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def prev_power_of_2(n: int) -> int:
    """Largest power of two <= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


_AUTOTUNE_S = [0.0]


def timed_bench(bench):
    """``bench`` (a Triton ``do_bench``) that adds the seconds it runs to :func:`autotune_seconds`: what the
    autotuners of these kernels spent benchmarking in this process (disk-cache hits spend none)."""
    import time

    def run(kernel_call, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return bench(kernel_call, *args, **kwargs)
        finally:
            _AUTOTUNE_S[0] += time.perf_counter() - t0

    return run


def autotune_seconds() -> float:
    """Seconds the kernels' autotuners have spent benchmarking in this process."""
    return _AUTOTUNE_S[0]
