"""Several nodes: searchers on every node, one replay buffer on trainer rank 0. On one node nothing here runs
(runtime/fleet.py's Fleet holds `nodes`: None). How to launch, how it works (the leaders' meetings, `Nodes`;
the plain data that crosses nodes, `encode` and `decode`) and what a fault does: docs/nodes.md.
"""

import datetime
import json
import os

import numpy as np
import torch
import torch.distributed as dist

from buffer import Trajectory, from_arrays, to_arrays
from runtime.errors import ConfigError

POLL = 0.25  # s between two meetings of the leaders while rank 0 waits for data
CONTINUE, DONE, FAILED = 0, 1, 2  # rank 0's decision after a meeting


def allowance(timeout: float) -> datetime.timedelta:
    """How long a collective may wait, in the default group and the leaders' alike. Rank 0's long waits answer
    the others every slice (ranks.wait_together) and every POLL on several nodes; what remains is a rank's
    time alone between two collectives: a weight-sync lock (up to --timeout) or rank 0 writing a checkpoint (a
    2.8B one is about 33 GB: minutes on a slow disk)."""
    return datetime.timedelta(seconds=2 * timeout + 600)


def layout(world: int) -> tuple[int, int]:
    """(nodes, trainer ranks on this node) from torchrun's environment."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check(cfg, world: int):
    """Launches over several nodes that cannot work, refused in one line before anything starts."""
    nodes, local = layout(world)
    if world != nodes * local:
        raise ConfigError(f"--nproc-per-node: every node must run the same number of trainer ranks; this node "
                          f"runs {local}, but the {nodes} nodes run {world} in all")
    if nodes > 1 and cfg.searchers == 0:
        raise ConfigError("--searchers: 0 (the trainer searching itself) runs in one process on one node; "
                          f"got {nodes} nodes")
    line = nodes > 1 and unreachable(os.environ)
    if line:
        raise ConfigError(line)


def unreachable(environ) -> str | None:
    """The line for a node whose CPU collectives would wait until --timeout, or None. gloo, which carries
    them (the leaders' meetings, every decision), listens on the address this machine's name resolves
    to unless GLOO_SOCKET_IFNAME names an interface (PyTorch's ProcessGroupGloo.cpp, createDefaultDevice;
    it falls back to loopback when the name does not resolve), and stock Debian and Ubuntu resolve it to
    127.0.1.1 (/etc/hosts): nodes on other machines then cannot reach this one. Said when the master
    address is another machine's; launches on one machine (as the tests run them) work on loopback."""
    import ipaddress
    import socket
    import psutil
    master = environ.get("MASTER_ADDR")
    if environ.get("GLOO_SOCKET_IFNAME") or not master:
        return None
    addresses = lambda name: {a[4][0].split("%")[0] for a in socket.getaddrinfo(name, None)}
    try:
        masters = addresses(master)
    except OSError:
        return None  # torchrun's rendezvous says so
    mine = {a.address.split("%")[0] for links in psutil.net_if_addrs().values() for a in links}
    host = socket.gethostname()
    try:
        named = addresses(host)
    except OSError:
        named = set()
    if masters & (mine | named) or any(not ipaddress.ip_address(a).is_loopback for a in named):
        return None
    return (f"GLOO_SOCKET_IFNAME: this machine's name {host!r} resolves to {', '.join(sorted(named)) or 'no address'}"
            f"{' (loopback)' if named else ''}, where gloo would listen for the CPU collectives, and the master "
            f"{master} is another machine, which cannot reach it: every collective would wait until --timeout. "
            f"Set GLOO_SOCKET_IFNAME to the network interface the nodes reach each other on (`ip -brief address` "
            f"lists them), on every node: GLOO_SOCKET_IFNAME=eth0 torchrun ... (docs/nodes.md)")


class Nodes:
    """The leaders' meetings of a run over several nodes (every trainer rank makes one; the meetings and
    the counts are the leaders'; runtime.fleet.Fleet.collect holds them)."""

    def __init__(self, world: int, local: int, timeout: float):
        self.count, self.rank = world // local, dist.get_rank()
        # every rank takes part in making a group, members or not (torch.distributed.new_group)
        self.group = dist.new_group(list(range(0, world, local)), backend="gloo", timeout=allowance(timeout))
        self.samples = [0] * self.count      # rank 0: trajectories received from each node other than 0
        self.versions = [None] * self.count  # rank 0: newest weight version among them
        self.heard = [False] * self.count    # rank 0: a node's searchers have sent trajectories

    def gather(self, payload: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: each leader's payload (uint8 tensors of any length); the others: None."""
        n = torch.tensor([payload.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.count)] if self.rank == 0 else None
        dist.gather(n, sizes, dst=0, group=self.group)
        longest = max(int(s) for s in sizes) if self.rank == 0 else 0
        box = torch.tensor([longest], dtype=torch.int64)  # gloo's gather wants one size on every member
        dist.broadcast(box, src=0, group=self.group)
        padded = torch.zeros(int(box), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        parts = [torch.empty_like(padded) for _ in range(self.count)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0, group=self.group)
        return [p[:int(s)] for p, s in zip(parts, sizes)] if self.rank == 0 else None

    def decide(self, decision: int) -> int:
        """Rank 0's decision after a meeting (CONTINUE, DONE, FAILED), on every leader."""
        box = torch.tensor([decision])
        dist.broadcast(box, src=0, group=self.group)
        return int(box)

    def received(self, node: int, trajectories: list[Trajectory]):
        """Rank 0: count what came from `node` (for the rows and the first step's wait for every node)."""
        self.samples[node] += len(trajectories)
        self.versions[node] = max([t.version for t in trajectories] + [self.versions[node] or 0])
        self.heard[node] = self.heard[node] or bool(trajectories)

    def row(self, samples: int) -> dict:
        """The train row's fields: trajectories from each node so far (node 0: the rest of `samples`)
        and the newest weight version received from each other node."""
        return dict(samples_per_node=[samples - sum(self.samples)] + self.samples[1:],
                    version_per_node=[None] + self.versions[1:])


# --- the wire format: plain numbers and arrays, never pickle ------------------------------------
def encode(trajectories: list[Trajectory], error: str | None = None, silent: str | None = None,
           said=()) -> torch.Tensor:
    """uint8: 8-byte little-endian header length, the JSON header (an error line, a silent line, lines to
    print, and each array's name, dtype and length), then the arrays of `buffer.to_arrays` (little-endian)."""
    arrays = {k: v.astype(v.dtype.newbyteorder("<")) for k, v in to_arrays(trajectories).items()}
    head = json.dumps({"error": error, "silent": silent, "said": list(said),
                       "arrays": [[k, v.dtype.str, list(v.shape)] for k, v in arrays.items()]}).encode()
    data = len(head).to_bytes(8, "little") + head + b"".join(v.tobytes() for v in arrays.values())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(payload: torch.Tensor) -> tuple[list[Trajectory], dict]:
    """The trajectories of `encode` and its report {"error", "silent": a line or None, "said": [lines]};
    ValueError if it does not parse as one."""
    data = payload.numpy().tobytes()
    n = int.from_bytes(data[:8], "little")
    try:
        head = json.loads(data[8:8 + n])
        report = {k: head[k] for k in ("error", "silent", "said")}
        if not (all(report[k] is None or isinstance(report[k], str) for k in ("error", "silent"))
                and isinstance(report["said"], list) and all(isinstance(x, str) for x in report["said"])):
            raise ValueError("a report that is not lines of text")
        arrays, at = {}, 8 + n
        for name, dtype, shape in head["arrays"]:
            dtype = np.dtype(dtype)
            if dtype.kind not in "iuf" or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"array {name!r} is not numbers")
            size = int(np.prod(shape)) * dtype.itemsize
            if at + size > len(data):
                raise ValueError("lengths do not add up")
            arrays[name] = np.frombuffer(data[at:at + size], dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
            at += size
        if at != len(data):
            raise ValueError("lengths do not add up")
        trajectories = from_arrays(arrays)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"a message from another node does not parse ({e})") from None
    return trajectories, report


def lost(e: BaseException, rank: int, world: int) -> str | None:
    """The line for a collective that failed because another trainer rank (another node, on several) went away; None
    for other errors. gloo raises RuntimeError ("Connection closed by peer" when the other process died, a timeout
    when its machine is unreachable: third_party/gloo/gloo/transport/tcp/pair.cc); c10d's own errors are DistError
    subclasses. On one node the other rank is named where there are two (gloo names only an address)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    gone = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe")
    if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(g in text for g in gone)):
        text = text.split("] ", 1)[-1].split(". This is typically")[0]  # gloo's source location and advice
        other = ("another node of the run" if layout(world)[0] > 1 else
                 f"trainer rank {1 - rank}" if world == 2 else "another trainer rank")
        return f"lost contact with {other} ({text}); stopping"
    return None
