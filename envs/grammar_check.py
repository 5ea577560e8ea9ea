"""``check_grammar``: an env's grammar walked before any episode, so a grammar that can never produce a finished
answer is one line at the start, not a dead end (or a run of truncated episodes) in the middle of training.

For the grammar of each agent turn of a few of the task's prompts it checks, on the env's own tokenizer, that the
grammar compiles (a JSON schema with an unknown type, say), that some token may start the turn (a regex of
characters outside the vocabulary allows none), and that a token path the mask allows reaches an accepting state
(where EOS is allowed) within the env's ``max_new_tokens``: a grammar that forbids the end, or whose every path
runs into a dead end, fails here, and so does one with a dead end no deeper than its shortest finished answer (a
path the vocabulary cannot go on from, which sampling can take; deeper ones stop a run in one line when met).

The walk is a breadth-first beam: each depth keeps a few states per distinct next-token mask (two states with the
same mask are usually the same place in the grammar), preferring states whose mask is new; so a loop of one mask
costs one state per depth, and the cost stays bounded for a vocabulary of any size.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["check_grammar", "finish_within"]

_WIDTH = 24  # states kept per depth
_PER_MASK = 3  # states kept per distinct next-token mask
_FANOUT = 48  # tokens tried from one state (all of them where fewer are allowed)


def _allowed(bits: bytes, vocab_size: int) -> np.ndarray:
    """Bool ``[V]`` from a matcher's ``compute_bitmask()``: the tokens it allows next."""
    return np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[:vocab_size].astype(bool)


def _fanout(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The allowed ``ids`` tried from one state, at most ``_FANOUT`` beyond the one-character tokens: those (up to
    256, the finest steps, among them whatever closes a string or a bracket), the longest (few of them reach far)
    and an even spread of the rest."""
    if len(ids) <= _FANOUT:
        return ids
    single = ids[lengths[ids] <= 1][:256]
    order = ids[np.argsort(-lengths[ids], kind="stable")]
    half = _FANOUT // 2
    spread = ids[np.linspace(0, len(ids) - 1, half).astype(int)]
    return np.unique(np.concatenate([single, order[:half], spread]))


def finish_within(matcher: Any, budget: int, vocab_size: int, skip: Any, lengths: np.ndarray) -> dict[str, Any]:
    """Walk ``matcher`` (an llguidance matcher at the start of a turn) for a token path to an accepting state.

    Returns ``{"tokens": n}`` (a path of ``n`` tokens reaches one; with ``"partial": prefix`` where a state met at
    most that deep, ``prefix`` in, allows nothing and does not accept: a dead end that sampling can reach),
    ``{"start": True}`` (no token may start), ``{"dead": prefix}`` (every path tried ends where no token may follow, ``prefix`` the longest; with
    ``"error": (path, message)`` where the engine itself stopped on a token the mask allowed) or
    ``{"budget": budget}`` (none within ``budget`` tokens). ``lengths[V]``: each token's text length; ``skip``: ids
    never walked (EOS, and the specials llguidance allows where no real token can go on)."""
    frontier, seen = [(matcher, [], matcher.compute_bitmask())], set()
    longest: list[int] = []
    first_dead: list[int] | None = None
    error: tuple[list[int], str] | None = None
    skip = [int(i) for i in skip if i is not None and 0 <= i < vocab_size]

    def real(bits: bytes) -> np.ndarray:  # the tokens a state allows, but for those never walked
        allowed = _allowed(bits, vocab_size)
        allowed[skip] = False
        return allowed

    for depth in range(budget + 1):
        if any(state.is_accepting() for state, _, _ in frontier):
            # a finished answer at this depth; a state met on the way where nothing may follow is a dead end that
            # sampling can reach
            dead = first_dead or next((path for state, path, bits in frontier
                                       if not state.is_accepting() and not real(bits).any()), None)
            return {"tokens": depth} if dead is None else {"tokens": depth, "partial": dead}
        children: dict[bytes, list[tuple[Any, list[int], bytes]]] = {}
        for state, path, bits in frontier:
            ids = np.flatnonzero(real(bits))
            if not len(ids):
                if depth == 0:
                    return {"start": True}
                longest = path if len(path) > len(longest) else longest
                first_dead = path if first_dead is None else first_dead
                continue
            if depth == budget:
                continue
            for t in _fanout(ids, lengths).tolist():
                child = state.deep_copy()
                if not child.consume_token(t) or child.is_error():
                    error = error or (path + [t], str(child.get_error() or "").strip())
                    continue
                child_bits = child.compute_bitmask()
                key = child_bits + bytes([child.is_accepting()])
                if len(children.setdefault(key, [])) < _PER_MASK:
                    children[key].append((child, path + [t], child_bits))
        if not children:
            if depth < budget:
                return {"dead": longest, "error": error} if error else {"dead": longest}
            return {"budget": budget}
        new = [k for k in children if k not in seen]
        old = [k for k in children if k in seen]
        seen.update(children)
        frontier = [s for k in new + old for s in children[k]][:_WIDTH]
    return {"budget": budget}


def _turns(task: Any) -> range:
    """The agent turns whose grammars are checked: the first, and a multi-turn task's next few."""
    if not getattr(task, "multi_turn", False):
        return range(1)
    return range(min(task.max_turns or 4, 4))


def check_grammar(env: Any, prompts: int = 2) -> None:
    """Raise ``ValueError`` (one line) if the grammar of an agent turn of ``env`` (a
    :class:`~tokengym.envs.TokenVectorEnv`) cannot be followed to a finished answer: it does not compile, allows no
    token at the start, or reaches no accepting state within ``max_new_tokens`` (see the module). Checks the
    grammars of ``prompts`` of the task's prompts (drawn with a fixed seed; the env's own state is untouched); an
    env without a grammar passes. Each grammar is checked once.

    Example:
        >>> from tokengym.envs import TokenVectorEnv
        >>> check_grammar(TokenVectorEnv(1, "arithmetic", grammar={"regex": "[0-9]+"}))
        >>> check_grammar(TokenVectorEnv(1, "arithmetic", grammar={"regex": "[0-9]+=[0-9]{9}"}, max_new_tokens=8))
        Traceback (most recent call last):
        ...
        ValueError: its grammar {'regex': '[0-9]+=[0-9]{9}'} reaches no accepting state (where EOS is allowed) within max_new_tokens=8: ...
    """
    masker = getattr(env, "masker", None)
    if masker is None or masker.spec_for is None:
        return
    tok, V = env.tokenizer, env.vocab_size
    lengths = np.array([len(t or "") for t in tok.convert_ids_to_tokens(list(range(V)))])
    skip = {tok.eos_token_id, tok.unk_token_id, tok.pad_token_id, tok.bos_token_id} - {None}
    done: set[str] = set()
    for sample in env.task.batch(np.random.default_rng(0), prompts):
        for turn in _turns(env.task):
            spec = masker.spec_for(sample, turn)
            key = json.dumps(spec, sort_keys=True, default=str)
            if spec is None or key in done:
                continue
            done.add(key)
            where = f"its grammar {spec!r:.80}" + (f" (agent turn {turn})" if env.task.multi_turn else "")
            got = finish_within(masker.new_matcher(spec), env.max_new_tokens, V, sorted(skip), lengths)
            if "start" in got:
                raise ValueError(f"{where} allows no token at the start of the answer: no token of the tokenizer "
                                 f"({V} tokens) begins a match; is it written for characters the vocabulary lacks?")
            if got.get("error"):
                path, err = got["error"]
                raise ValueError(f"{where} stops the grammar engine after {tok.decode(path)!r}: "
                                 f"{err.splitlines()[0] if err else 'no reason given'}")
            if "dead" in got:
                raise ValueError(f"{where} reaches a dead end on every path (after {tok.decode(got['dead'])!r}, no token "
                                 "of the tokenizer may follow) and never accepts: fix the grammar")
            if got.get("partial") is not None:
                raise ValueError(f"{where} can reach a dead end: after {tok.decode(got['partial'])!r} no token of the "
                                 "tokenizer may follow, though other answers finish (an episode sampled there would stop "
                                 "the run): fix the grammar")
            if "budget" in got:
                raise ValueError(f"{where} reaches no accepting state (where EOS is allowed) within max_new_tokens="
                                 f"{env.max_new_tokens}: every episode would be cut off unfinished; does it forbid the "
                                 "end (a required part the vocabulary cannot spell)? Fix it, or raise max_new_tokens")
