"""What tokengym adds to vLLM's worker (``worker_extension_cls``): in-place weight loads by name, with a version.

vLLM imports this module inside its worker, so it imports nothing from tokengym. The backend
(:class:`~tokengym.agents.engine.vllm_backend.VLLMGenerator`) calls these methods through ``LLM.collective_rpc``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WeightLoader"]


class WeightLoader:
    """Methods mixed into vLLM's worker class."""

    def tokengym_check(self) -> str | None:
        """``None`` when this worker can reload weights in place (``reload_weights``, which re-runs vLLM's weight
        processing, e.g. the CPU backend's repacking), else what is missing."""
        return None if callable(getattr(self, "reload_weights", None)) else "its worker has no reload_weights()"

    def tokengym_load(self, items: list[tuple[str, Any]], version: int | None) -> int | None:
        """Load ``(name, tensor)`` pairs (the Hugging Face names; vLLM fuses them as at start-up) as ``version``."""
        self.reload_weights(weights_iterator=iter(items))
        self._tokengym_version = version
        return version

    def tokengym_mark(self, version: int | None) -> int | None:
        """Record that the weights this worker started with are ``version``."""
        self._tokengym_version = version
        return version

    def tokengym_version(self) -> int | None:
        """The version of the weights this worker holds (``None``: those it started with)."""
        return getattr(self, "_tokengym_version", None)
