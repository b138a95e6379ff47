"""Typed errors of the prefill node; the gRPC layer maps each family to one status code.

Three-way policy: running out of resources is normal and is returned
as a value (wait), never raised; a broken invariant raises ``InvariantError`` (a bug);
bad input raises a subclass of ``InvalidRequestError`` whose message says what to fix.
"""

from __future__ import annotations


class WaveppError(Exception):
    """Base of every error this package raises on purpose."""


class InvalidRequestError(WaveppError, ValueError):
    """The caller sent something wrong (maps to INVALID_ARGUMENT)."""


class NeverFitsError(WaveppError):
    """The request can never fit, e.g. larger than a stage's whole cache (RESOURCE_EXHAUSTED)."""


class OverloadedError(WaveppError):
    """The tier is too busy to answer this request in time, said at once instead of late
    (RESOURCE_EXHAUSTED, with the trailer ``retry-after-ms``): a router's queue is full, or
    the request is predicted to finish after its deadline. ``retry_after_s``: when a retry is
    predicted to fare better."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(WaveppError):
    """The pipeline is down or not ready (UNAVAILABLE).

    ``failover`` says why a router may send the request to another pipeline: the failure came
    before anything of it reached the caller or its decode side (a prefill has no other side
    effect), so running it elsewhere duplicates nothing. None: it may not be retried there.
    """

    failover: str | None = "pipeline_unavailable"


class RequestAbortedError(WaveppError):
    """The request was aborted or cancelled before it finished (CANCELLED)."""


class DeadlineExceededError(RequestAbortedError):
    """The request's deadline (``PrefillOptions.deadline_s``) passed before it finished; the
    engine aborted it and freed its blocks on every stage (DEADLINE_EXCEEDED)."""


class InvariantError(WaveppError, RuntimeError):
    """An internal invariant is broken: a bug, never the caller's fault (INTERNAL)."""


class ModelLoadError(WaveppError):
    """A model could not be loaded; subclasses say why."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """A checkpoint file or directory that should exist does not."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture / model family is not implemented."""


class UnsupportedQuantizationError(ModelLoadError):
    """A checkpoint stores weights in a quantisation we do not load: a GGUF tensor type, a
    ``quantization_config`` other than block-wise FP8, or low-precision tensors without
    their scales."""


class InvalidModelConfigError(ModelLoadError):
    """A model config (config.json or a ModelConfig) is malformed or inconsistent."""


class MissingTensorError(ModelLoadError):
    """A checkpoint lacks a tensor the model (or this stage's slice of it) needs."""


class InvalidPartitionError(InvalidRequestError):
    """A layer partition cannot be built: more stages than layers, or bad stage weights."""


class InvalidPromptError(InvalidRequestError):
    """The prompt is empty, too long for the model, or holds a token id outside the vocabulary."""


class InvalidKVDestinationError(InvalidRequestError):
    """A request's KV destination (push or pull) is malformed."""


class StageStateError(WaveppError):
    """A stage's cache state does not match the chunk it was told to run (INTERNAL, per request).

    The request fails; the stage never computes on the wrong cache state.
    """


class KVHandoffError(UnavailableError):
    """Shipping a request's KV to its decode worker failed: decode unreachable, died
    mid-transfer or slower than the transfer timeout (UNAVAILABLE). The request fails, every
    stage has released its blocks, and the pipeline keeps serving. ``cause`` is the
    kv_transfer error of the first stage that failed. ``decode_saw_bytes``: some of the KV
    may have reached decode (a push WRITE); False only when decode has seen nothing (pull:
    decode reads after the answer), the one case a router may retry elsewhere."""

    def __init__(
        self, message: str, cause: Exception | None = None, *, decode_saw_bytes: bool = True
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.failover = None if decode_saw_bytes else "kv_handoff"
