"""Requests shaped like LLM traffic: prompt and output lengths, streaming share, tenants.

By default prompt lengths follow a Pareto law truncated to [min, max] tokens (Zipf-like, alpha
1.2, the field's 10..4096): P(L > x) = ((m/x)^a - (m/M)^a) / (1 - (m/M)^a), and output lengths
(max_tokens) are log-normal around a median. `--prompt-tokens` / `--output-tokens` replace
either law with a fixed count (`512`), a uniform (`uniform:100:500`) or a normal law
(`normal:256:64`, kept within 1..4x the mean), to shape traffic like a peer benchmark's.
Every prompt also carries a fixed context template (512 tokens by default) as its system
message. Texts come from `llmchaos.stack.tokens.make_text`, so the tokens the load chooses are
the tokens the engine charges.

Plain Python, no gevent: a request is built as bytes here and sent by the user (user.py).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from llmchaos.configuration import Range, check_ranges
from llmchaos.errors import InvalidInput
from llmchaos.stack.tokens import make_text

__all__ = [
    "BAD_TOKEN_KINDS",
    "LengthLaw",
    "RequestSpec",
    "Tenant",
    "TrafficModel",
    "TrafficSpec",
    "check_bad_tokens",
    "load_tenants",
    "parse_length",
    "tenants_of",
]

BAD_TOKEN_KINDS = ("mixed", "revoked", "unknown")
"""Which bad tokens are sent (LoadConfig.bad_tokens explains why they differ)."""


@dataclass(frozen=True)
class Tenant:
    """One API token from the tokens file."""

    token: str
    tenant: str
    revoked: bool = False


@dataclass(frozen=True)
class TrafficSpec:
    """The request mix: one definition with one set of defaults, used by the load's library
    (`LoadConfig.traffic`), its command line (the flags in brackets), the Locust processes
    and a chaos run's settings (configuration keys of the same names). Checked when built;
    InvalidInput names the field."""

    model: str = "llmchaos-7b"
    """Model name in every request [--model] (the embedded stack serves llmchaos-7b)."""
    stream_share: float = 0.3
    """Share of streaming (SSE) requests, where TTFT, ITL and TPOT are measured
    [--stream-share]."""
    prompt_alpha: float = 1.2
    """Tail exponent of the Zipf-like prompt length law (field: 1.2)."""
    prompt_min_tokens: int = 10
    """Shortest user prompt in tokens (field: 10)."""
    prompt_max_tokens: int = 4096
    """Longest user prompt in tokens (field: 4096)."""
    prompt_tokens: str | None = None
    """User-prompt length law [--prompt-tokens]: `N`, `uniform:LO:HI` or `normal:MEAN:SD`;
    None: the Zipf-like law of prompt_alpha, prompt_min_tokens and prompt_max_tokens."""
    context_tokens: int = 512
    """Context template sent as the system message of every request (field: 512 tokens;
    0: none) [--context-tokens]."""
    output_median_tokens: int = 8
    """Median max_tokens (log-normal, sigma `output_sigma`, so P99 ~5x the median). 8: short
    answers, so that the embedded stack's two simulated GPUs carry the catalogue's rate with
    one of them killed; typical chat is ~64 (set it, or --output-tokens, on a cluster)."""
    output_sigma: float = 0.7
    """Spread of the log-normal max_tokens law."""
    output_max_tokens: int = 1024
    """Largest max_tokens drawn."""
    output_tokens: str | None = None
    """max_tokens law [--output-tokens], the forms of prompt_tokens; None: log-normal around
    output_median_tokens."""
    ignore_eos: bool = False
    """Send `ignore_eos: true` (vLLM's extension) so that a real model produces exactly
    max_tokens, as peer benchmarks do for fixed output lengths [--ignore-eos]. The embedded
    stack's engines never stop early anyway."""
    bad_token_share: float = 0.0
    """Share of requests sent with a revoked or unknown token [--bad-token-share] (auth
    chaos)."""
    bad_tokens: str = "mixed"
    """Which bad tokens that share sends [--bad-tokens]: "mixed" (default, half revoked tokens
    from the tokens file, half random unknown ones), "revoked" (only revoked tokens of the
    file; the file must have some when bad_token_share > 0) or "unknown" (only random unknown
    tokens). The two test different things: after a mass token refresh clients keep sending
    the same few stale tokens, which is what negative caching protects against; random
    unknown tokens never repeat, so each is a cache miss that reaches the token table (cache
    penetration), which negative caching cannot stop."""

    RANGES: ClassVar[dict[str, Range]] = {
        "stream_share": Range(0, 1),
        "prompt_alpha": Range(0, 10, low_open=True),
        "prompt_min_tokens": Range(1, 1_000_000),
        "prompt_max_tokens": Range(1, 1_000_000),
        "context_tokens": Range(0, 1_000_000),
        "output_median_tokens": Range(1, 32_768),
        "output_sigma": Range(0, 5),
        "output_max_tokens": Range(1, 1_000_000),
        "bad_token_share": Range(0, 1),
    }

    def __post_init__(self) -> None:
        check_ranges(self, self.RANGES)
        if self.prompt_min_tokens > self.prompt_max_tokens:
            raise InvalidInput(
                "prompt_min_tokens: expected at most prompt_max_tokens "
                f"({self.prompt_max_tokens}), got {self.prompt_min_tokens}"
            )
        check_bad_tokens(self.bad_tokens, self.bad_token_share, None)
        for law, name in (
            (self.prompt_tokens, "prompt_tokens"),
            (self.output_tokens, "output_tokens"),
        ):
            if law is not None:
                parse_length(law, name)


@dataclass(frozen=True)
class LengthLaw:
    """Token counts drawn from a fixed, uniform or normal law (see the module docstring)."""

    kind: str
    a: int
    b: int = 0

    @property
    def mean(self) -> float:
        """Mean token count (a normal law's mean: its clipping to [1, 4 x mean] is ignored)."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else float(self.a)

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.randint(self.a, self.b)
        return max(1, min(round(rng.gauss(self.a, self.b)), 4 * self.a))


def parse_length(text: str, flag: str) -> LengthLaw:
    """`N`, `uniform:LO:HI` or `normal:MEAN:SD` (token counts >= 1).

    Raises InvalidInput naming `flag`, the value and the expected forms.
    """
    parts = text.split(":")
    try:
        numbers = [int(p) for p in parts[1:]] if len(parts) > 1 else [int(parts[0])]
    except ValueError:
        numbers = []
    kind = "fixed" if len(parts) == 1 else parts[0]
    shapes = {"fixed": 1, "uniform": 2, "normal": 2}
    if kind in shapes and len(numbers) == shapes[kind] and numbers[0] >= 1:
        if kind == "fixed":
            return LengthLaw("fixed", numbers[0])
        if kind == "uniform" and numbers[1] >= numbers[0]:
            return LengthLaw("uniform", numbers[0], numbers[1])
        if kind == "normal" and numbers[1] >= 0:
            return LengthLaw("normal", numbers[0], numbers[1])
    raise InvalidInput(
        f"{flag}: expected N, uniform:LO:HI (1 <= LO <= HI) or normal:MEAN:SD (MEAN >= 1, "
        f"SD >= 0), token counts as integers; got {text!r}"
    )


@dataclass(frozen=True)
class RequestSpec:
    """A ready-to-send request."""

    body: bytes
    headers: dict[str, str]
    stream: bool
    tenant: str
    prompt_tokens: int
    max_tokens: int


def load_tenants(path: str | Path) -> list[Tenant]:
    """Read `{"tokens": [{"token", "tenant", "revoked"}, ...]}`.

    Raises InvalidInput naming --tokens when the file is unreadable, not JSON, or malformed.
    """
    try:
        data = json.loads(Path(path).read_text())
        entries = data["tokens"]
        tenants = [
            Tenant(str(e["token"]), str(e.get("tenant", "default")), bool(e.get("revoked", False)))
            for e in entries
        ]
    except OSError as exc:
        raise InvalidInput(f"--tokens: cannot read {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(
            f"--tokens: {path} is not a tokens file "
            f'{{"tokens": [{{"token": "...", "tenant": "...", "revoked": false}}]}} ({exc!r})'
        ) from None
    if not any(not t.revoked for t in tenants):
        raise InvalidInput(f"--tokens: {path} has no token that is not revoked")
    return tenants


def tenants_of(tokens_file: str | None, api_key_env: str | None) -> list[Tenant] | None:
    """The tokens a load sends: its tokens file, else the one key in `api_key_env` (tenant
    "api-key"), else None (no Authorization header)."""
    if tokens_file:
        return load_tenants(tokens_file)
    if api_key_env:
        return [Tenant(os.environ[api_key_env], "api-key", False)]
    return None


def check_bad_tokens(kind: str, share: float, tenants: Sequence[Tenant] | None) -> None:
    """Raises InvalidInput naming --bad-tokens for an unknown kind, or for "revoked" with a
    share > 0 and no revoked token among `tenants` (None: not read yet, only the kind is checked).
    """
    if kind not in BAD_TOKEN_KINDS:
        raise InvalidInput(
            f"bad_tokens: expected one of {', '.join(BAD_TOKEN_KINDS)}, got {kind!r}"
        )
    if (
        kind == "revoked"
        and share > 0
        and tenants is not None
        and not any(t.revoked for t in tenants)
    ):
        raise InvalidInput(
            "bad_tokens: 'revoked' with bad_token_share > 0 needs revoked tokens in the "
            "tokens file (--tokens), and there are none"
        )


class TrafficModel:
    """Draws requests; one per worker, seeded, not thread-safe (one gevent hub)."""

    def __init__(self, spec: TrafficSpec, tenants: list[Tenant] | None = None, seed: int = 0):
        """Raises InvalidInput for a bad `spec.bad_tokens` (see check_bad_tokens)."""
        check_bad_tokens(spec.bad_tokens, spec.bad_token_share, tenants)
        self.spec = spec
        self._rng = random.Random(seed)
        self._valid = [t for t in tenants or [] if not t.revoked]
        self._revoked = [t for t in tenants or [] if t.revoked]
        self._ratio = (spec.prompt_min_tokens / spec.prompt_max_tokens) ** spec.prompt_alpha
        self._prompt_law = (
            None
            if spec.prompt_tokens is None
            else parse_length(spec.prompt_tokens, "prompt_tokens")
        )
        self._output_law = (
            None
            if spec.output_tokens is None
            else parse_length(spec.output_tokens, "output_tokens")
        )
        self._content: dict[int, bytes] = {}
        model = b'{"model":' + json.dumps(spec.model).encode() + b',"messages":['
        system = b""
        if spec.context_tokens > 0:
            context = make_text(spec.context_tokens, offset=7).encode()
            system = b'{"role":"system","content":"' + context + b'"},'
        self._prefix = model + system + b'{"role":"user","content":"'
        self._options = b',"ignore_eos":true' if spec.ignore_eos else b""

    def prompt_tokens(self) -> int:
        """A user-prompt length: the configured law, else the truncated Pareto law."""
        if self._prompt_law is not None:
            return self._prompt_law.draw(self._rng)
        u = self._rng.random()
        x = self.spec.prompt_min_tokens * (1.0 - u * (1.0 - self._ratio)) ** (
            -1.0 / self.spec.prompt_alpha
        )
        return min(int(x), self.spec.prompt_max_tokens)

    def output_tokens(self) -> int:
        """A max_tokens value: the configured law, else log-normal around the median, within
        1..output_max_tokens."""
        if self._output_law is not None:
            return self._output_law.draw(self._rng)
        x = self._rng.lognormvariate(
            math.log(self.spec.output_median_tokens), self.spec.output_sigma
        )
        return max(1, min(int(x), self.spec.output_max_tokens))

    def _tenant(self) -> tuple[str, str]:
        """(tenant name, Authorization value); a share of revoked or unknown tokens if asked."""
        if not self._valid:
            return "anonymous", ""
        if self.spec.bad_token_share and self._rng.random() < self.spec.bad_token_share:
            kind = self.spec.bad_tokens
            # "mixed" draws its coin only when the file has revoked tokens, as it always did:
            # the same seed keeps giving the same run.
            if kind == "revoked" or (
                kind == "mixed" and self._revoked and self._rng.random() < 0.5
            ):
                t = self._rng.choice(self._revoked)
                return t.tenant, f"Bearer {t.token}"
            return "unknown", f"Bearer unknown-{self._rng.getrandbits(64):016x}"
        t = self._rng.choice(self._valid)
        return t.tenant, f"Bearer {t.token}"

    def next_request(self) -> RequestSpec:
        """A complete request: body bytes, headers (auth, W3C traceparent), metadata."""
        n_prompt = self.prompt_tokens()
        content = self._content.get(n_prompt)
        if content is None:
            # Words are plain ASCII, so the text needs no JSON escaping.
            content = self._content[n_prompt] = make_text(n_prompt, offset=n_prompt).encode()
        max_tokens = self.output_tokens()
        stream = self._rng.random() < self.spec.stream_share
        tail = b',"stream":true,"stream_options":{"include_usage":true}}' if stream else b"}"
        body = (
            self._prefix
            + content
            + b'"}],"max_tokens":'
            + str(max_tokens).encode()
            + self._options
            + tail
        )
        tenant, auth = self._tenant()
        trace_id = self._rng.getrandbits(128) or 1
        span_id = self._rng.getrandbits(64) or 1
        headers = {
            "Content-Type": "application/json",
            "traceparent": f"00-{trace_id:032x}-{span_id:016x}-01",
        }
        if auth:
            headers["Authorization"] = auth
        return RequestSpec(
            body=body,
            headers=headers,
            stream=stream,
            tenant=tenant,
            prompt_tokens=self.spec.context_tokens + n_prompt,
            max_tokens=max_tokens,
        )
