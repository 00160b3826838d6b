"""envd: the daemon that runs inside every sandbox and speaks E2B's envd protocol.

Submodules are imported lazily; importing this package costs nothing. The host side
uses ``protocol`` (port, version, file signatures) and ``bundle`` (envd's runtime).
"""

from .protocol import ENVD_PORT, ENVD_VERSION, file_signature

DEFAULT_PORT = ENVD_PORT

__all__ = ["DEFAULT_PORT", "ENVD_PORT", "ENVD_VERSION", "file_signature"]
