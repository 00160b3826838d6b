"""envd: the daemon that runs inside every sandbox and speaks E2B's envd protocol.

Submodules are imported lazily; importing this package costs nothing.
"""

# Version reported to SDKs (the API returns it as the sandbox's ``envdVersion``).
# The SDK gates features on it; every feature up to this version is implemented.
ENVD_VERSION = "0.6.4"
DEFAULT_PORT = 49983
