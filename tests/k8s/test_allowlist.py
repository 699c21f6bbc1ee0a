"""The namespace allowlist compares exactly: a name is allowed only when it is, character for
character, a namespace name (a DNS label) listed in allowed_namespaces and not a system one.
No regex `$` trap ("kube-system\\n"), no case or whitespace folding."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmchaos.errors import InvalidInput
from llmchaos.targets.kubernetes import (
    PROTECTED_NAMESPACES,
    KubernetesSettings,
    check_settings,
)

_LABEL_CHARS = string.ascii_lowercase + string.digits + "-"


def is_dns_label(name: str) -> bool:
    """RFC 1123 label, written out by hand (not the code's regex): 1-63 of [a-z0-9-], starting
    and ending with a letter or digit."""
    return (
        0 < len(name) <= 63
        and all(c in _LABEL_CHARS for c in name)
        and name[0] != "-"
        and name[-1] != "-"
    )


names = st.one_of(
    st.text(max_size=70),
    st.text(alphabet=_LABEL_CHARS, min_size=1, max_size=70),
    st.sampled_from(sorted(PROTECTED_NAMESPACES)).flatmap(
        lambda protected: st.sampled_from(
            [protected, protected + "\n", " " + protected, protected.upper(), protected + "\x00"]
        )
    ),
)


def _accepted(namespace: str, allowed: tuple[str, ...]) -> bool:
    try:
        check_settings(KubernetesSettings(namespace=namespace, allowed_namespaces=allowed))
    except InvalidInput:
        return False
    return True


@given(name=names)
def test_a_namespace_is_allowed_exactly_when_it_is_a_listed_label_and_not_a_system_one(
    name: str,
) -> None:
    expected = is_dns_label(name) and name not in PROTECTED_NAMESPACES
    assert _accepted(name, (name,)) == expected, repr(name)


@given(name=names, listed=st.text(alphabet=_LABEL_CHARS, min_size=1, max_size=20))
def test_the_namespace_must_be_listed_verbatim(name: str, listed: str) -> None:
    if _accepted(name, (listed,)):
        assert name == listed


@pytest.mark.parametrize("trap", ["kube-system\n", "kube-system ", "Kube-System", "kube-system\r"])
def test_the_known_traps_are_refused(trap: str) -> None:
    assert not _accepted(trap, (trap,))


@pytest.mark.parametrize("address", ["runner", "runner:", ":5557", "runner:0", "runner:70000"])
def test_a_load_master_address_must_be_host_and_port(address: str) -> None:
    with pytest.raises(InvalidInput, match="load_master_address: expected HOST:PORT"):
        check_settings(
            KubernetesSettings(
                namespace="llm", allowed_namespaces=("llm",), load_master_address=address
            )
        )
    check_settings(
        KubernetesSettings(
            namespace="llm", allowed_namespaces=("llm",), load_master_address="10.0.0.5:5557"
        )
    )
