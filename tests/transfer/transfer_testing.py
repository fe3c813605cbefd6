"""Shared constants of the transfer tests (a uniquely named module, unlike ``conftest``)."""

#: The secret every test engine and peer process shares.
SECRET = bytes(range(100, 132))
