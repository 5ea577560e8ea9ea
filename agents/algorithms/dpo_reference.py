"""The reference side of :class:`~tokengym.agents.algorithms.dpo.DPOLearner`: which model scores the reference
log-probs and in what context, those log-probs live or precomputed once per dataset, resetting the reference to the
current policy, and the choice of batch layout (shared-prefix packing, verified once on the model and reference).

The reference is a frozen ``Policy`` (a copy of the policy, or a model given), an
:class:`~tokengym.agents.engine.policy.AdapterDisabledReference` (a LoRA policy with its adapter off), or ``None``
with ``precompute_ref``: the policy itself scores the pairs before each fit's first update.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from tokengym.agents.engine.models import frozen_copy
from tokengym.agents.engine.policy import AdapterDisabledReference, make_reference
from tokengym.agents.data.pairs import PairBatch, PairData, SharedPrefixBatch
from tokengym.agents.algorithms.dpo_logps import sequence_logps

__all__ = ["DPOReference"]


def _wrap_policy(model: Any, like: Any) -> Any:
    """A frozen ``Policy`` around ``model`` with ``like``'s tokenizer and temperature (``model`` may already be one)."""
    if not (hasattr(model, "prefill") and hasattr(model, "model")):
        model = type(like)(model, like.tokenizer, temperature=like.temperature, fast_decode=False, packing=getattr(like, "packing", "off"))
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _frozen(module: torch.nn.Module) -> Iterator[None]:
    """``module`` in eval mode without autograd, its training mode restored on exit."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


class DPOReference:
    """Mixin of :class:`~tokengym.agents.algorithms.dpo.DPOLearner`: its reference model and batch log-probs.

    Uses the learner's ``policy``, ``config`` (``batch_size``, ``ref_batch_size``, ``precompute_ref``), ``ref`` and
    ``_share_prefix`` (``config.share_prefix``, resolved on first use of :attr:`share_prefix`).
    """

    sequence_logps = staticmethod(sequence_logps)

    def _initial_reference(self, ref: Any) -> Any:
        """The reference for the constructor's ``ref`` argument (see :class:`DPOLearner`)."""
        if isinstance(ref, AdapterDisabledReference):
            return ref
        if ref is not None:
            return _wrap_policy(ref, self.policy)
        if self.config.precompute_ref:
            return None  # reference log-probs come from the policy before each fit's first update
        return make_reference(self.policy)

    # ------------------------------------------------------------------ batch layout
    @property
    def share_prefix(self) -> bool:
        """Whether batches are prefix-shared and packed: ``config.share_prefix``, or when that is ``None``
        the result of a one-time check (:meth:`_packing_matches`, run on first use)."""
        if self._share_prefix is None:
            self._share_prefix = self._packing_matches()
        return self._share_prefix

    def _packing_matches(self) -> bool:
        """Whether the packed path gives the plain stack's log-probs here: three synthetic pairs (left padding,
        a shared prefix, none, a rejected completion extending the chosen one) scored both ways by the
        policy and by a reference model of its own. A model that rejects or ignores the 4D mask fails."""
        g = torch.Generator().manual_seed(0)
        vocab = self.policy.model.get_input_embeddings().num_embeddings

        def ids(n: int) -> list[int]:
            return torch.randint(vocab, (n,), generator=g).tolist()

        common = ids(3)
        chosen = [common + ids(4), ids(5), common]
        data = PairData.from_token_ids([ids(3), ids(6), ids(4)], chosen, [common + ids(2), ids(3), common + ids(3)],
                                       pad_id=int(self.policy.tokenizer.pad_token_id or 0))
        idx = torch.arange(len(data))
        scorers = [(self.policy, _frozen(self.policy))]
        if isinstance(self.ref, torch.nn.Module):
            scorers.append((self.ref, torch.no_grad()))
        for model, ctx in scorers:
            try:
                with ctx:
                    plain = self.sequence_logps(model, data.batch(idx, self.policy.device)).float()
                    packed = self.sequence_logps(model, data.shared_batch(idx, self.policy.device)).float()
            except (TypeError, ValueError, RuntimeError, NotImplementedError):
                return False
            tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 3e-2  # per scored token
            lens = data.completion_lens.reshape(-1).to(plain.device)
            if not bool(((plain - packed).abs() <= tol * (lens + 1)).all()):
                return False
        return True

    def _batch(self, data: PairData, idx: torch.Tensor) -> PairBatch | SharedPrefixBatch:
        """The pairs ``idx`` of ``data`` on the policy's device, packed or as a plain stack (see :attr:`share_prefix`)."""
        if self.share_prefix:
            return data.shared_batch(idx, self.policy.device)
        return data.batch(idx, self.policy.device)

    # ------------------------------------------------------------------ reference log-probs
    def _reference(self) -> tuple[Any, contextlib.AbstractContextManager]:
        """The policy that scores reference log-probs and the context to score in (no autograd, no dropout)."""
        if self.ref is None:  # precompute_ref: the policy itself, before the fit's first update
            return self.policy, _frozen(self.policy)
        if isinstance(self.ref, AdapterDisabledReference):
            return self.ref.policy, self.ref.disabled()
        return self.ref, torch.no_grad()  # a frozen Policy

    def reference_logps(self, data: PairData, batch_size: int | None = None) -> torch.Tensor:
        """Reference log-probs ``[2, N]`` (summed over completion tokens; ``[0]`` chosen, ``[1]`` rejected) of every pair.

        Uses the reference model, or the policy itself when the learner keeps none (``precompute_ref``).
        """
        bs = batch_size or self.config.ref_batch_size or 4 * self.config.batch_size
        out = torch.empty(2, len(data), dtype=torch.float32)
        self.share_prefix  # resolve the packing check outside the reference's context
        model, ctx = self._reference()
        with ctx:
            for idx in torch.arange(len(data)).split(bs):
                out[:, idx] = self.sequence_logps(model, self._batch(data, idx)).float().cpu().view(2, -1)
        return out

    def _ref_batch(self, batch: PairBatch | SharedPrefixBatch, cached: torch.Tensor | None) -> torch.Tensor:
        """Reference log-probs ``[2B]`` of ``batch``: from ``cached`` (:meth:`reference_logps`), else scored now."""
        if cached is not None:
            return cached[:, batch.index].reshape(-1).to(self.policy.device)
        model, ctx = self._reference()
        with ctx:
            return self.sequence_logps(model, batch)

    def reset_reference(self) -> None:
        """Make the current policy the reference: a fresh frozen copy (also for a LoRA policy, whose
        adapter-disabled base is only its *initial* policy); nothing to do with ``precompute_ref`` and no
        reference model (every ``fit`` then takes its reference from the policy at its start)."""
        if self.ref is None:
            return
        self.ref = _wrap_policy(frozen_copy(self.policy.model), self.policy)

