"""A song's progress in English on stderr, as upstream shows it: a bar per stage, its tokens for the AR phases
("Planning score", "Generating song"), its steps for the NAR ("Synthesizing audio") and its tiles for the VAE
("Decoding audio"). `yue2-vllm generate` shows it unless --quiet; a pipeline built with `progress=True` shows it for
the songs it runs. What it shows never enters a record or an identity.
"""
from __future__ import annotations

import sys


class Progress:
    """tqdm bars on stderr: tokens per AR phase, steps for the NAR, tiles for the VAE."""

    LABELS = {"abc": "Planning score", "semantic": "Generating song", "nar": "Synthesizing audio",
              "vae": "Decoding audio"}

    def __init__(self, enabled: bool, token_budget: dict[str, int | None], done: dict[str, int] | None = None):
        self.enabled, self.token_budget = enabled, token_budget
        self.done = done or {}  # tokens a phase has before it starts (a continued song's)
        self.stage, self.bar = None, None

    def _switch(self, stage: str, total: int | None) -> None:
        if self.stage == stage:
            return
        self.close()
        self.stage = stage
        if self.enabled:
            from tqdm import tqdm

            unit = "tok" if stage in ("abc", "semantic") else ("step" if stage == "nar" else "tile")
            self.bar = tqdm(total=total, desc=self.LABELS[stage], unit=unit, file=sys.stderr, leave=True,
                            initial=self.done.get(stage, 0))

    def on_token(self, phase: str, token: int) -> None:
        self._switch(phase, self.token_budget.get(phase))
        if self.bar is not None:
            self.bar.update(1)

    def on_progress(self, stage: str, done: int, total: int) -> None:
        if stage not in self.LABELS:  # a wait for room (`nar_wait`, ...): the stage's bar shows when it runs
            return
        self._switch(stage, total)
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.stage = None, None


def token_budgets(rules, request, overrides: dict) -> dict:
    """Each phase's token budget under `rules` (the bars' totals; None where it does not resolve: refused later)."""
    budget = {}
    for phase in ("abc", "semantic"):
        try:
            budget[phase] = rules.phase_sampling(request, overrides.get(phase), phase).max_tokens
        except ValueError:
            budget[phase] = None
    return budget
