"""Two rule sets of Kubernetes, applied to rendered objects the way the cluster would:

- `restricted_violations`: the Pod Security Standards' "restricted" profile (Kubernetes 1.30), the
  rules Pod Security Admission enforces on a namespace labelled
  pod-security.kubernetes.io/enforce=restricted. checkov does not read a RayService's pod
  templates, so these rules check those (and every other pod the chart makes).
- `admits`: whether NetworkPolicies let a connection in, or out: a pod that no policy of a
  direction selects is open in that direction; otherwise the union of the selecting policies'
  rules decides (peers by pod and namespace labels, or an IP block; ports by number)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod_spec: dict) -> list[str]:
    """Every way `pod_spec` (a PodSpec, with all its containers) breaks the restricted profile."""
    errors: list[str] = []
    pod_ctx = pod_spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            errors.append(f"spec.{key}")
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            errors.append(f"volume {volume['name']}: {sorted(kinds - _RESTRICTED_VOLUMES)}")
    for sysctl in pod_ctx.get("sysctls") or []:
        if sysctl["name"] not in _SAFE_SYSCTLS:
            errors.append(f"sysctl {sysctl['name']}")
    containers = [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]
    for c in containers:
        ctx = c.get("securityContext") or {}
        name = c["name"]
        if ctx.get("privileged"):
            errors.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            errors.append(f"{name}: allowPrivilegeEscalation is not false")
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            errors.append(f"{name}: capabilities.drop lacks ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            errors.append(f"{name}: capabilities.add {sorted(set(capabilities['add']) - {'NET_BIND_SERVICE'})}")
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            errors.append(f"{name}: runAsNonRoot is not true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            errors.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            errors.append(f"{name}: seccompProfile {seccomp}")
        if ctx.get("procMount", "Default") != "Default":
            errors.append(f"{name}: procMount")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            errors.append(f"{name}: hostPort")
    return errors


@dataclass(frozen=True)
class Pod:
    """One end of a connection: a pod (its namespace and labels) or, with `ip`, an address outside."""

    namespace: str = ""
    labels: dict = field(default_factory=dict)
    namespace_labels: dict = field(default_factory=dict)
    ip: str = ""

    def __hash__(self):
        return hash((self.namespace, tuple(sorted(self.labels.items())), self.ip))

    @property
    def ns_labels(self) -> dict:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector's verdict on `labels` (an empty selector selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, other: Pod) -> bool:
    if "ipBlock" in peer:
        if not other.ip:
            return False
        block = peer["ipBlock"]
        address = ipaddress.ip_address(other.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except") or [])
    if other.ip:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.ns_labels):
            return False
    elif other.namespace != policy_ns:
        return False
    return selects(peer.get("podSelector") or {}, other.labels)


def _port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    return any(p.get("protocol", "TCP") == protocol and (
        "port" not in p or p["port"] == port or p.get("endPort", -1) >= port >= p.get("port", 0)) for p in ports)


def _direction_admits(policies: list[dict], pod: Pod, other: Pod, port: int, protocol: str, direction: str) -> bool:
    peers_key = "from" if direction == "Ingress" else "to"
    rules_key = direction.lower()
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and selects(p["spec"]["podSelector"], pod.labels)
                 and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(rules_key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(peer, pod.namespace, other) for peer in peers)) \
                    and _port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def admits(policies: list[dict], source: Pod, target: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether a connection from `source` to `target`:port gets through: out of the source (its
    egress policies, when it is a pod) and into the target (its ingress policies)."""
    out = source.ip or _direction_admits(policies, source, target, port, protocol, "Egress")
    return bool(out) and _direction_admits(policies, target, source, port, protocol, "Ingress")
