"""Subnets of stacks that start at the same moment (other processes, as two `chaos run`s)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

from llmchaos.stack import netns

PICK_AND_HOLD = """
import sys, time
from llmchaos.stack import netns
print(netns.pick_subnet(), flush=True)
sys.stdin.readline()  # hold the claim (no address is ever created) until told to end
"""


def test_stacks_starting_at_once_pick_different_subnets() -> None:
    """Neither has an address in its /24 yet: before the claim both picked the first free
    one, and the second stack's namespaces collided with the first's (seen as a failed
    `stack up` while interrupt tests ran beside other runs)."""
    pickers = [
        subprocess.Popen(
            [sys.executable, "-c", PICK_AND_HOLD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        picked = [p.stdout.readline().strip() for p in pickers if p.stdout is not None]
    finally:
        for picker in pickers:
            picker.communicate("\n", timeout=30)
    assert len(picked) == 3 and all(p.startswith("10.203.") for p in picked), picked
    assert len(set(picked)) == 3, picked


def test_a_claim_ends_with_its_process() -> None:
    """The claim is an abstract socket: nothing on disk, gone when its holder ends."""
    done = subprocess.run(
        [sys.executable, "-c", PICK_AND_HOLD], input="\n", capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    subnet = ipaddress.ip_network(done.stdout.strip())
    assert netns._claim(subnet)  # free again
    netns._release(subnet)
