"""What lossy step a block's bytes went through, and the error that step can make.

A block read from memkv says which step it went through (``lossy``: "" for
exact bytes); this table gives each step's bound, so a reader can decide
whether the bytes are good enough for it. Steps are ordered by how much they
can lose; a block that went through two keeps the worse name (errors add up:
the bound shown is the worse step's, the first step's is smaller).

On the wire a step travels as its code (a msgpack fixint beside ``exact``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOSSY_CODES", "LOSSY_STEPS", "LossyStep", "lossy_name", "worse"]


@dataclass(frozen=True, slots=True)
class LossyStep:
    code: int
    name: str
    bound: str


LOSSY_STEPS: dict[str, LossyStep] = {
    step.name: step
    for step in (
        LossyStep(0, "", "exact: the bytes the writer sent"),
        LossyStep(
            1,
            "float16",
            "fp16 rounding of a float32 block: relative error <= 2^-11 per element "
            "(values beyond fp16's range are never converted)",
        ),
        LossyStep(
            2,
            "int8",
            "int8, keys per channel and values per token (symmetric): |error| <= "
            "max|x| / 254 of each channel or token",
        ),
        LossyStep(
            3,
            "delta_rl",
            "the offline Delta+RL codec, stepped codes (the default, codecs.delta_rl_step "
            "= 0.5): |error| <= scale / 2 per element, scale = max(step x RMS, absmax / 127) "
            "of its key channel (less its mean) or value token, i.e. <= RMS / 4 at the "
            "default step (plus rounding to the block dtype); with delta_rl_bits: 4, half a "
            "step of each 4-bit group, (max - min) / 30",
        ),
    )
}
LOSSY_CODES: dict[int, str] = {step.code: name for name, step in LOSSY_STEPS.items()}


def worse(a: str, b: str | None) -> str:
    """The step of the two that can lose more."""
    if not b:
        return a
    return b if LOSSY_STEPS[b].code > LOSSY_STEPS[a].code else a


def lossy_name(code: object) -> str:
    """The step of a wire code ("" for exact, and for a code this version does not know
    of, which a reader must then treat as lossy: see ``exact``)."""
    return LOSSY_CODES.get(code, "") if isinstance(code, int) else ""
