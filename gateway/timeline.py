"""A request's record told as what happened, in order (`timeline`: arrived → queued → admitted → replica chosen,
and why → each attempt → first token → end) and as where its time went (`phases`: the queue, each attempt that
failed, the prompt, the generation), from the record alone: the API gives both, the CLI prints the one, the
dashboard draws the other."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from gateway.records import RESUMED


class Recorded(Protocol):
    """What of a record (gateway.models.RequestRecord) the story is told from."""

    priority: str
    surface: str
    streamed: bool
    model: str
    asked: str
    client: str
    status: int
    error: str
    waited_ms: float | None
    position: int | None
    route: dict[str, object]
    tries: list[list[object]]
    ttft_ms: float | None
    total_ms: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_ms: float | None
    generation_ms: float | None


class Step(NamedTuple):
    at_ms: float  # from its arrival
    what: str


class Phase(NamedTuple):
    name: str
    start_ms: float
    end_ms: float
    kind: str  # queue, failed (an attempt), prompt, generation, engine (the two, when not told apart)


def _ms(value: float) -> str:
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _tries(r: Recorded) -> list[tuple[str, float, float, str]]:
    out = []
    for t in r.tries or []:
        if isinstance(t, (list, tuple)) and len(t) == 4:
            replica, started, ended, outcome = t
            out.append((str(replica), float(started), float(ended), str(outcome)))  # type: ignore[arg-type]
    return out


def why(route: dict[str, object]) -> str:
    """A choice's reasons in words: `prefix (its prefix's replica)`, and each replica passed over."""
    if not route:
        return ""
    hit = route.get("hit")
    said = f"{route.get('policy')}" + (f", its {hit}'s replica" if hit else "")
    passed = route.get("passed") or []
    if isinstance(passed, list) and passed:
        said += "; passed over " + ", ".join(f"{p[0]} ({p[1]})" for p in passed if isinstance(p, list) and len(p) == 2)
    return said


def engine_figures(r: Recorded) -> str:
    """The engine's own figures: its cache, its time on the prompt and generating."""
    parts = []
    if r.prompt_tokens or r.cached_tokens:
        parts.append(f"{r.prompt_tokens} prompt tokens ({r.cached_tokens} from its cache)"
                     + (f" in {_ms(r.prompt_ms)}" if r.prompt_ms is not None else ""))
    if r.completion_tokens or r.generation_ms is not None:
        parts.append(f"{r.completion_tokens} generated" + (f" in {_ms(r.generation_ms)}" if r.generation_ms is not None
                                                            else ""))
    return ", ".join(parts)


def timeline(r: Recorded) -> list[Step]:
    asked = f" (asked as {r.asked})" if r.asked and r.asked != r.model else ""
    steps = [Step(0.0, f"arrived from {r.client or '-'}: /v1/{r.surface}{' streamed' if r.streamed else ''} for "
                       f"{r.model or '-'}{asked}, class {r.priority or '-'}")]
    tries = _tries(r)
    if r.position is not None:
        steps.append(Step(0.0, f"queued at position {r.position} in its model's queue"))
    if tries and tries[0][1] >= 1.0:
        steps.append(Step(tries[0][1], f"admitted: a replica and a slot after {_ms(tries[0][1])}"))
    for i, (replica, started, ended, outcome) in enumerate(tries):
        last = i == len(tries) - 1
        if last and r.route:
            steps.append(Step(started, f"replica {replica} chosen: {why(r.route)}"))
        if i and tries[i - 1][3].endswith(RESUMED):
            steps.append(Step(started, f"attempt {i + 1}: resumed on {replica}, the answer going on from where "
                                       f"{tries[i - 1][0]} broke off"))
        else:
            steps.append(Step(started, f"attempt {i + 1}: sent to {replica}"))
        if outcome.endswith(RESUMED):
            steps.append(Step(ended, f"attempt {i + 1}: {replica} {outcome.removesuffix(RESUMED)}: resumed on "
                                     + (f"{tries[i + 1][0]}" if not last else "another replica")))
        else:
            steps.append(Step(ended, f"attempt {i + 1}: {replica} {outcome}"))
    if r.ttft_ms is not None:
        steps.append(Step(r.ttft_ms, "first token"))
    if tries and (said := engine_figures(r)):
        steps.append(Step(r.total_ms, f"the engine: {said}"))
    steps.append(Step(r.total_ms, f"ended: {r.status}{' ' + r.error if r.error else ''}"
                                  f" after {_ms(r.total_ms)}, {r.prompt_tokens}+{r.completion_tokens} tokens"))
    return sorted(steps, key=lambda s: s.at_ms)  # stable: as told at the same moment


def phases(r: Recorded) -> list[Phase]:
    tries = _tries(r)
    out = []
    first = tries[0][1] if tries else (r.waited_ms or 0.0)
    if first >= 1.0:
        out.append(Phase(f"queue {_ms(first)}" + (f" (position {r.position})" if r.position is not None else ""),
                         0.0, first, "queue"))
    for replica, started, ended, outcome in tries[:-1]:
        out.append(Phase(f"{replica}: {outcome}", started, ended, "failed"))
    if tries:
        replica, started, ended, outcome = tries[-1]
        if len(tries) > 1 and tries[-2][3].endswith(RESUMED) and outcome.startswith("answered 2"):
            # its first token came from a replica before: the rest of the answer is this one's
            out.append(Phase(f"resumed on {replica} {_ms(r.total_ms - started)}", started, r.total_ms, "generation"))
        elif not outcome.startswith("answered 2"):
            out.append(Phase(f"{replica}: {outcome}", started, max(ended, started), "failed"))
        elif r.ttft_ms is not None:  # a stream: its first token ends the prompt's part
            out.append(Phase(f"prompt {_ms(r.ttft_ms - started)}", started, r.ttft_ms, "prompt"))
            out.append(Phase(f"generation {_ms(r.total_ms - r.ttft_ms)}", r.ttft_ms, r.total_ms, "generation"))
        elif r.prompt_ms is not None:  # a whole answer: as the engine told its time
            prompt_end = min(r.total_ms, started + r.prompt_ms)
            out.append(Phase(f"prompt {_ms(r.prompt_ms)}", started, prompt_end, "prompt"))
            generated = r.generation_ms if r.generation_ms is not None else r.total_ms - prompt_end
            out.append(Phase(f"generation {_ms(generated)}", prompt_end, r.total_ms, "generation"))
        else:
            out.append(Phase(f"{replica} {_ms(r.total_ms - started)}", started, r.total_ms, "engine"))
    return out
