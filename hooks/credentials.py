"""Named sender credentials, each scoped to the nodes it may report on (RECOVERY_HOOKS_CREDENTIALS_FILE).

A YAML (or JSON) file::

    credentials:
      - name: alertmanager                 # in logs and /metrics, never the secret
        token_file: /etc/training-recovery/alertmanager-token
        nodes: "*"                         # every node
      - name: rack-7-shipper
        token: "..."                       # or inline
        nodes: gpu-[1-32]                  # a Slurm hostlist
    node_agents:                           # optional: every node's agent has a token of its own,
      master_key_file: /etc/training-recovery/node-agent-key   # HMAC-SHA256(master key, node name)
      nodes: gpu-[1-512]                   # the nodes that have one (a hostlist, not "*")

A request whose alerts name a node outside its credential's nodes is refused whole (403).
``python -m hooks.credentials NODE`` prints NODE's agent token, from the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import hostlist
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from hooks.problems import location

EVERY_NODE = "*"
CredentialName = Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]  # safe as a Prometheus label value


@dataclass(frozen=True)
class Credential:
    """Who sent a request, and the nodes it may report on (None: every node)."""

    name: str
    nodes: frozenset[str] | None

    def outside(self, nodes: Iterable[str]) -> list[str]:
        """The given nodes this credential may not report on, each once, in order."""
        if self.nodes is None:
            return []
        return list(dict.fromkeys(n for n in nodes if n not in self.nodes))


def node_scope(text: str) -> frozenset[str] | None:
    """The nodes of a hostlist, or None for '*' (every node)."""
    if text.strip() == EVERY_NODE:
        return None
    try:
        nodes = frozenset(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist as e:
        raise ValueError(f"nodes {text!r} is not a Slurm hostlist: {e}") from None
    if not nodes:
        raise ValueError("nodes is empty: name a hostlist, or '*' for every node")
    return nodes


def _check_scope(text: str) -> str:
    node_scope(text)
    return text


NodeScope = Annotated[str, AfterValidator(_check_scope)]  # "*" or a Slurm hostlist


def agent_token(master_key: bytes, node: str) -> str:
    """A node agent's bearer token: HMAC-SHA256(master key, node name), hex."""
    return hmac.new(master_key, node.encode(), hashlib.sha256).hexdigest()


def _read_secret(value: SecretStr | None, path: Path | None, what: str) -> bytes:
    if (value is None) == (path is None):
        raise ValueError(f"give {what} or {what}_file, exactly one")
    text = value.get_secret_value() if value is not None else path.read_text()  # type: ignore[union-attr]
    if not text.strip():
        raise ValueError(f"{what} is empty or only whitespace")
    return text.strip().encode()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NamedCredential(_Strict):
    name: CredentialName
    token: SecretStr | None = None
    token_file: Path | None = None
    nodes: NodeScope

    def secret(self) -> bytes:
        return _read_secret(self.token, self.token_file, "token")


class NodeAgents(_Strict):
    master_key: SecretStr | None = None
    master_key_file: Path | None = None
    nodes: NodeScope

    def key(self) -> bytes:
        return _read_secret(self.master_key, self.master_key_file, "master_key")


class CredentialsFile(_Strict):
    credentials: list[NamedCredential] = []
    node_agents: NodeAgents | None = None

    @model_validator(mode="after")
    def _names_unique_and_agents_listed(self) -> CredentialsFile:
        names = [c.name for c in self.credentials]
        if len(set(names)) != len(names):
            raise ValueError("credential names must be unique")
        if self.node_agents is not None and node_scope(self.node_agents.nodes) is None:
            raise ValueError("node_agents.nodes must be a hostlist: each listed node gets a token")
        return self

    @classmethod
    def read(cls, path: Path) -> CredentialsFile:
        try:
            return cls.model_validate(yaml.safe_load(path.read_text()) or {})
        except yaml.YAMLError as e:  # its message quotes the file, tokens and all: say only where
            mark = getattr(e, "problem_mark", None)
            raise ValueError("not YAML or JSON" + (f" (line {mark.line + 1})" if mark else "")) from None
        except ValidationError as e:  # said without the input: it holds the tokens
            raise ValueError(
                "; ".join(
                    f"{location(err['loc']) if err['loc'] else 'the file'}: {err['msg']}"
                    for err in e.errors(include_input=False)
                )
            ) from None

    def bearer_tokens(self) -> Iterator[tuple[bytes, Credential]]:
        """Every token in the file with its credential; secrets read from their files now."""
        for c in self.credentials:
            yield c.secret(), Credential(c.name, node_scope(c.nodes))
        if self.node_agents is not None:
            key = self.node_agents.key()
            for node in sorted(node_scope(self.node_agents.nodes) or ()):
                yield agent_token(key, node).encode(), Credential(f"node-agent.{node}", frozenset([node]))


class BearerTokens:
    """Tokens to credentials, looked up by the token's SHA-256: the lookup's timing depends only on
    the digest of what was presented, which tells a guesser nothing about any token."""

    def __init__(self, tokens: Iterable[tuple[bytes, Credential]]) -> None:
        self._by_digest: dict[bytes, Credential] = {}
        for token, credential in tokens:
            digest = hashlib.sha256(token).digest()
            if digest in self._by_digest:  # one token, two scopes: which one applies would be a guess
                raise ValueError(
                    f"credentials {self._by_digest[digest].name} and {credential.name} have the same token"
                )
            self._by_digest[digest] = credential

    def find(self, token: bytes) -> Credential | None:
        return self._by_digest.get(hashlib.sha256(token).digest())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hooks.credentials", description="print a node agent's bearer token"
    )
    parser.add_argument("node")
    parser.add_argument(
        "--file",
        type=Path,
        default=os.environ.get("RECOVERY_HOOKS_CREDENTIALS_FILE"),
        help="the credentials file (default RECOVERY_HOOKS_CREDENTIALS_FILE)",
    )
    args = parser.parse_args(argv)
    try:
        if args.file is None:
            raise ValueError("no credentials file: set RECOVERY_HOOKS_CREDENTIALS_FILE or pass --file")
        agents = CredentialsFile.read(args.file).node_agents
        if agents is None:
            raise ValueError(f"{args.file} has no node_agents")
        if args.node not in (node_scope(agents.nodes) or ()):
            raise ValueError(f"{args.node} is not in node_agents.nodes ({agents.nodes})")
        print(agent_token(agents.key(), args.node))
    except (OSError, ValueError) as e:
        print(f"credentials: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
