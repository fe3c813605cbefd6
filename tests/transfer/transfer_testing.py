"""Shared constants and helpers of the transfer tests (a uniquely named module, unlike
``conftest``)."""

import time

#: The secret every test engine and peer process shares.
SECRET = bytes(range(100, 132))


def eventually(predicate, timeout_s: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes (a receiver's
    notifications and a peer's clean-up run just after the sender's call returns)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
