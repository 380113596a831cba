"""The seed paper's stream model (seeds/000), in its notation: its equations (``eq3_*`` .. ``eq13_*``), its
one-level setting (:class:`PaperSetting`) and its Algorithm 1's pair counts (:func:`pair_counts`, Table VII).
:mod:`.cost_model` applies it to a torchtitan job. See docs/planning.md, "The seed paper's model".

An expert domain of S ranks is torchtitan's expert FSDP group (it all-gathers its experts before use and
reduce-scatters their gradients), and the all-to-all group its EP group. Where the paper and this reading differ:

- Table IV's absolute p values (0.75, 0.5) do not follow from its own numbers at 128 Gbit/s (p* = 0.976 and
  0.952), and its text also gives 0.5 and 0.25; the tests check what is consistent: the case and the ratio.
- Algorithm 1 read literally (only the inner coordinates compared) puts all-gathers across data centres: 208 AG
  pairs in Fig. 8b's 4 x 4 example. Here two ranks are compared at the one level where their coordinates differ
  (64 AG and 16 A2A pairs there, the one-level formulas summed over the levels; the paper prints no counts).
- Section V-B maps p = 0, 0.5, 0.75, 1 to S = 8, 4, 2, 1; eqs. 3-4 need p = (G - S)/(G - 1) (0.571 at S = 4).
  The advisor works in S directly.
- Eq. 7 hides all expert compute under the all-to-alls; the advisor keeps expert compute in the step's compute
  and every all-to-all exposed. The paper has no latency term, one level and forward only; the advisor adds a
  start-up latency per collective, runs levels' links side by side, counts backward (four all-to-alls, the
  re-gather, the reduce-scatter) and models the de-duplicating backends' copies.
"""

import itertools
import math
from dataclasses import dataclass


# ---- the paper's equations, its notation (D: a GPU's token bytes, P_E: expert bytes, B: bandwidth) ----


def eq3_a2a_volume(D: float, a2a_group: int) -> float:
    """Eq. 3: bytes one GPU sends by all-to-all: its D split in |G^A2A| chunks, all but its own leave."""
    return D / a2a_group * (a2a_group - 1)


def eq4_ag_volume(P_E: float, ag_group: int) -> float:
    """Eq. 4: bytes one GPU receives by the experts' all-gather: one P_E from each other GPU of its domain."""
    return P_E * (ag_group - 1)


def eq2_compute_latency(pre_expert: float, n: int, expert: float) -> float:
    """Eq. 2: Lat_comp = Lat^PE + n Lat^Ep (pre-expert blocks, then n local experts)."""
    return pre_expert + n * expert


def eq5_comm_latency(ag: float, a2a: float) -> float:
    """Eq. 5: Lat_comm = Lat^AG + 2 Lat^A2A (experts gathered once; tokens dispatched and combined)."""
    return ag + 2 * a2a


def eq7_overlap_latency(pre_expert: float, ag: float, n: int, expert: float) -> float:
    """Eq. 7: pre-expert compute hides the experts' all-gather; expert compute hides under communication."""
    return min(pre_expert, ag) + n * expert


def eq8_final_latency(compute: float, comm: float, overlap: float) -> float:
    """Eq. 8: one GPU's latency, the two streams less what overlaps."""
    return compute + comm - overlap


def eq9_system_latency(per_gpu: list[float]) -> float:
    """Eq. 9: a synchronous step waits for its slowest GPU."""
    return max(per_gpu)


def eq11_latency(p: float, G: int, D: float, B: float, pre_expert: float) -> float:
    """Eq. 11, case 1 (Lat^PE >= Lat^AG): the all-gather is hidden, latency grows with p."""
    return pre_expert + 2 * D * (G - 1) / (B * G) * p


def eq12_latency(p: float, G: int, D: float, P_E: float, B: float) -> float:
    """Eq. 12, case 2 (Lat^PE < Lat^AG): the all-gather is exposed."""
    return p * (G - 1) * (2 * D - G * P_E) / (B * G) + (G - 1) * P_E / B


def case_boundary_p(G: int, P_E: float, B: float, pre_expert: float) -> float:
    """The p at which Lat^AG = Lat^PE (eqs. 11-12's ranges): 1 - B Lat^PE / (P_E (G-1))."""
    return 1 - B * pre_expert / (P_E * (G - 1))


def eq10_latency(p: float, G: int, D: float, P_E: float, B: float, pre_expert: float) -> float:
    """Eq. 10: eq. 11 where the all-gather hides behind pre-expert compute, else eq. 12."""
    if p >= case_boundary_p(G, P_E, B, pre_expert):
        return eq11_latency(p, G, D, B, pre_expert)
    return eq12_latency(p, G, D, P_E, B)


def optimal_p(G: int, D: float, P_E: float, B: float, pre_expert: float) -> float:
    """The paper's summary: p* = the case boundary when 2D < G P_E (case 2.1), else 0 (AG only, case 2.2).

    Clamped to [0, 1]: the boundary is negative when pre-expert compute hides a full all-gather.
    """
    if 2 * D >= G * P_E:
        return 0.0
    return min(1.0, max(0.0, case_boundary_p(G, P_E, B, pre_expert)))


def p_of_domain_size(G: int, S: int) -> float:
    """The A2A proportion of expert-domain size S: the G-1 peers minus the S-1 gathered from, over G-1."""
    return (G - S) / (G - 1)


@dataclass(frozen=True)
class PaperSetting:
    """The paper's one-level setting: G GPUs, one expert each, bandwidth-only links (no latency terms)."""

    G: int
    D: float
    """Bytes of tokens one GPU dispatches."""
    P_E: float
    """Bytes of one GPU's experts."""
    B: float
    """Bandwidth, bytes per second."""
    pre_expert: float
    """Lat^PE_comp, seconds."""

    def latency(self, S: int) -> float:
        """Eqs. 2-8 at expert-domain size S (A2A among the G/S domains, AG within one)."""
        a2a = eq3_a2a_volume(self.D, self.G // S) / self.B
        ag = eq4_ag_volume(self.P_E, S) / self.B
        compute = eq2_compute_latency(self.pre_expert, 1, 0.0)
        return eq8_final_latency(compute, eq5_comm_latency(ag, a2a), eq7_overlap_latency(self.pre_expert, ag, 1, 0.0))

    def domain_sizes(self) -> list[int]:
        return [S for S in range(1, self.G + 1) if self.G % S == 0]

    def best_domain_size(self) -> int:
        """The feasible S (a divisor of G) of least latency; ties go to the smaller domain."""
        return min(self.domain_sizes(), key=lambda S: (self.latency(S), S))


def eq13_coordinates(rank: int, fanouts: list[int]) -> list[int]:
    """Eq. 13: a global rank's coordinate at each level, outermost first (fanouts SF^0..SF^{L-1})."""
    coordinates = []
    for level in range(len(fanouts)):
        inner = math.prod(fanouts[level + 1 :])
        coordinates.append(rank // inner % fanouts[level])
    return coordinates


def pair_kind(rank_a: int, rank_b: int, fanouts: list[int], domain_sizes: list[int]) -> str | None:
    """Algorithm 1: "AG" when two ranks share an expert domain, "A2A" when they hold the same offset in
    different domains, None (no direct transfer) otherwise.

    The level compared is the one where the ranks' coordinates differ, all others equal (the
    paper's text reads as suffix-equality only, which would put all-gathers across data
    centres; this is the reading that keeps AG inside a domain).
    """
    a, b = eq13_coordinates(rank_a, fanouts), eq13_coordinates(rank_b, fanouts)
    differing = [level for level in range(len(fanouts)) if a[level] != b[level]]
    if len(differing) != 1:
        return None
    level = differing[0]
    S = domain_sizes[level]
    same_domain = a[level] // S == b[level] // S
    same_offset = a[level] % S == b[level] % S
    if same_domain and not same_offset:
        return "AG"
    if not same_domain and same_offset:
        return "A2A"
    return None


def pair_counts(fanouts: list[int], domain_sizes: list[int]) -> dict[str, int]:
    """Table VII: ordered GPU pairs that exchange experts (AG) or tokens (A2A)."""
    G = math.prod(fanouts)
    counts = {"AG": 0, "A2A": 0}
    for a, b in itertools.permutations(range(G), 2):
        kind = pair_kind(a, b, fanouts, domain_sizes)
        if kind is not None:
            counts[kind] += 1
    return counts


# ---- the same streams for a torchtitan job ----
