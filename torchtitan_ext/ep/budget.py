"""What one MoE layer may cost a GPU per training step: the budget each backend and feature declares, and the
device-cost ledger (:mod:`torchtitan_ext.measuring.device_ledger`) holds it to."""

from dataclasses import astuple, dataclass, replace


@dataclass(frozen=True)
class Budget:
    """Host syncs, collectives and host-to-device copies of one pass of one MoE layer."""

    host_syncs: int = 0
    """Times the host waits for the device (the kernel library's included)."""
    collectives: int = 0
    """Collectives issued on the EP group, and calls into a kernel library (which move tokens between ranks)."""
    h2d_copies: int = 0
    """Host-to-device copies, each from pinned memory without making the host wait (a blocking one: never)."""

    def __add__(self, other: "Budget") -> "Budget":
        return Budget(self.host_syncs + other.host_syncs, self.collectives + other.collectives,
                      self.h2d_copies + other.h2d_copies)


@dataclass(frozen=True)
class DeviceBudget:
    """One MoE layer's budget per training step, forward and backward apart, with the reason for each cost.

    Activation checkpointing's recompute repeats the forward, less what selective checkpointing saves: the
    collectives of the backend's ops on its save list (:meth:`recompute`).
    """

    forward: Budget
    backward: Budget
    why: str
    """What the costs are, in one line (reports quote it)."""
    counts_exchange: Budget = Budget()
    """Part of ``forward``: what the backend pays to learn every rank's pair counts, which it skips where the
    routing carries them (:attr:`torchtitan_ext.ep.base.Routing.sent_counts`)."""

    def __add__(self, other: "DeviceBudget") -> "DeviceBudget":
        return DeviceBudget(self.forward + other.forward, self.backward + other.backward, f"{self.why}; {other.why}",
                            self.counts_exchange + other.counts_exchange)

    def given_counts(self) -> "DeviceBudget":
        """This budget where the routing carries every rank's pair counts: without the counts' exchange."""
        forward = Budget(*(paid - spared for paid, spared in zip(astuple(self.forward), astuple(self.counts_exchange))))
        return replace(self, forward=forward, counts_exchange=Budget())

    def recompute(self, saves_collectives: bool) -> Budget:
        """The recompute pass's budget: the forward's, without its collectives where selective checkpointing saves
        the ops that issue them (``saves_collectives``)."""
        return replace(self.forward, collectives=0) if saves_collectives else self.forward

    def of(self, phase: str, saves_collectives: bool = False) -> Budget:
        return {"forward": self.forward, "backward": self.backward}.get(phase) or self.recompute(saves_collectives)
