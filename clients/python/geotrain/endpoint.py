"""Where the head is, which token to give it and which TLS files to use, found the way the `geotrain` CLI finds
them (common/rpc.h ResolveHead, TlsFromFlagsOrEnvironment): the arguments first, then GEOTRAIN_HEAD and
GEOTRAIN_TOKEN (or GEOTRAIN_TOKEN_FILE), GEOTRAIN_TLS_CA, GEOTRAIN_TLS_CERT and GEOTRAIN_TLS_KEY, then the record a
head started on this machine leaves in $GEOTRAIN_HOME (default ~/.geotrain)/current_cluster.json."""
import json
import os
from dataclasses import dataclass

from geotrain.errors import InvalidArgumentError, NotFoundError, UnauthenticatedError


@dataclass(frozen=True)
class Endpoint:
    address: str  # host:port of the head
    token: str

    def __repr__(self):  # the token stays out of logs and notebook outputs
        return f"Endpoint(address={self.address!r}, token=<{len(self.token)} characters>)"


def geotrain_home():
    return os.environ.get("GEOTRAIN_HOME") or os.path.join(os.environ.get("HOME", "/tmp"), ".geotrain")


def read_token_file(path):
    """The token in `path` without surrounding whitespace; errors name the file and the fix."""
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise UnauthenticatedError(f"token file: cannot read '{path}': {e.strerror}; copy the head's "
                                   f"<state-dir>/token there (mode 0600), or fix the path", "UNAUTHENTICATED") from e
    if not token:
        raise InvalidArgumentError(f"token file '{path}' is empty; copy the head's <state-dir>/token there",
                                   "INVALID_ARGUMENT")
    return token


def _token_from_arguments_or_environment(token, token_file):
    if token:
        return token
    if token_file:
        return read_token_file(token_file)
    if os.environ.get("GEOTRAIN_TOKEN"):
        return os.environ["GEOTRAIN_TOKEN"]
    if os.environ.get("GEOTRAIN_TOKEN_FILE"):
        try:
            return read_token_file(os.environ["GEOTRAIN_TOKEN_FILE"])
        except (UnauthenticatedError, InvalidArgumentError) as e:
            raise type(e)(f"GEOTRAIN_TOKEN_FILE: {e.message}", e.code) from e
    return ""


def _cluster_record():
    try:
        with open(os.path.join(geotrain_home(), "current_cluster.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("address") else None


def resolve_head(head=None, token=None, token_file=None):
    """The head's address and token: arguments, then the environment, then this machine's cluster record."""
    token = _token_from_arguments_or_environment(token, token_file)
    address = head or os.environ.get("GEOTRAIN_HEAD", "")
    if not address or not token:
        record = _cluster_record()
        if record:
            address = address or record["address"]
            if not token and record.get("token_file"):
                try:
                    token = read_token_file(record["token_file"])
                except (UnauthenticatedError, InvalidArgumentError):
                    pass
    if not address:
        raise NotFoundError("no head to talk to: pass head='HOST:PORT' or set GEOTRAIN_HEAD (no head was started "
                            "on this machine; start one with `geotrain head start`)", "NOT_FOUND")
    if not token:
        raise UnauthenticatedError("no cluster token: pass token_file=FILE or set GEOTRAIN_TOKEN_FILE (a copy of the "
                                   "head's <state-dir>/token, mode 0600), or pass token= / set GEOTRAIN_TOKEN",
                                   "UNAUTHENTICATED")
    return Endpoint(address, token)


@dataclass(frozen=True)
class TlsFiles:
    ca: str = ""  # the CA certificate (PEM) that signed the head's certificate
    cert: str = ""  # this client's certificate and key (PEM), for a head that asks for them (mutual TLS)
    key: str = ""

    @property
    def enabled(self):
        return bool(self.ca or self.cert or self.key)


def resolve_tls(ca=None, cert=None, key=None):
    """The TLS files, as the CLI finds them: the arguments when any is given, else GEOTRAIN_TLS_CA, GEOTRAIN_TLS_CERT
    and GEOTRAIN_TLS_KEY when any is set, else those recorded by a head started on this machine (or by `cluster up
    --tls`). All empty: plaintext."""
    given = TlsFiles(ca or "", cert or "", key or "")
    if given.enabled:
        return given
    environment = TlsFiles(*(os.environ.get(f"GEOTRAIN_TLS_{name}", "") for name in ("CA", "CERT", "KEY")))
    if environment.enabled:
        return environment
    record = _cluster_record() or {}
    recorded = TlsFiles(*(str(record.get(f"tls_{name}") or "") for name in ("ca", "cert", "key")))
    return recorded if recorded.enabled else given
