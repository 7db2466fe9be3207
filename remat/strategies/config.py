"""The search configuration: every time share and size threshold of the heuristics and the
exact strategies' search, documented in one place.

A problem carries one (``SolverSettings.search``); the defaults are the values the search
is tuned for. The reasons behind each default, with the measurements that chose them, are
in docs/solvers.md ("The search in detail" and "Measurements behind the defaults").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SearchConfig:
    """How the heuristics and the exact search divide their time and when each phase runs.

    Shares are fractions of the problem's time limit (``SolveOptions.time_limit_s``) unless
    said otherwise; seconds are wall-clock seconds.
    """

    # --- heuristics (``remat.strategies.heuristics``) -------------------------------------
    evict_time_s: float = 5.0
    """Greedy eviction's time budget when run as a strategy or as a warm start."""
    evict_fit_s: float = 60.0
    """Greedy eviction run as a strategy: how long (CPU time of its thread) its descent to
    a first plan that fits may run on past ``evict_time_s``, so that a busy machine does
    not turn a budget it meets into "infeasible"."""
    band_patience: int = 20
    """Greedy eviction on band placements stops after this many bands in a row bring no
    better plan."""
    placed_time_s: float = 5.0
    """The multi-device heuristic's time budget for its candidates (its local search gets
    as long again)."""
    placed_cuts: int = 8
    """Cut positions the multi-device heuristic tries per ordered pair of devices."""
    placed_keep: int = 3
    """Candidates the simulator must accept before the multi-device heuristic stops
    judging more."""

    # --- auto, the default strategy (``remat.strategies.auto``) --------------------------
    auto_exact_max_nodes: int = 1000
    """Auto ends with a short exact solve (``checkmate_milp``, or ``xengine`` on several
    devices) only on graphs of at most this many nodes (larger ones are decomposed by the
    exact search, which needs longer than a short solve)."""
    auto_exact_s: float = 10.0
    """Seconds of auto's exact solve, at most the time left of the problem's limit (none
    when less than ``min_solve_s`` is left)."""
    auto_skip_gap: float = 0.01
    """Relative: auto runs no exact solve when its best plan so far is this close to the
    ideal (every node once on its fastest device), a lower bound no solve can beat."""

    # --- warm start (``remat.strategies.exact.search``) -----------------------------------
    fit_share: float = 0.5
    """At most this share of the time limit, in CPU time of the heuristic's thread
    (``FitDeadline``), for a warm-start heuristic's descent to a first plan that fits: at
    tight budgets no baseline fits, and a heuristic cut short would leave the solvers
    without an incumbent."""
    warm_start_share: float = 0.25
    """At most this share of the time limit for the warm-start heuristics (capped by their
    own time budgets)."""

    # --- the full solve and the solves beside it ------------------------------------------
    min_solve_s: float = 1.0
    """The full model's solve gets at least this long (at most a quarter of a shorter
    limit), so that it reports a bound even after slow warm starts."""
    build_us: float = 4.0
    """Microseconds per unit of n (n + edges) x devices to build a full model (Checkmate's
    and XEngine's, measured at 60 to 235 nodes: 2 to 4 us): a time limit shorter than
    this estimate gets the warm start and a message saying how long the build takes,
    not a solve that cannot start."""
    solve_grace_s: float = 0.1
    """A solve of the search is stopped this long after its time limit: some backends do
    not check their limit during presolve."""
    proven_gap: float = 1e-9
    """Relative: an objective this close to a proven bound is optimal."""
    cover_s: float = 3.0
    """At most this long for each of the recomputation cover's and the closure cover's
    bounds (``exact.cover``), after the warm start and before the full solve."""
    device_cover_s: float = 30.0
    """At most this long (and a quarter of the time left, but at least ``min_solve_s``: at
    short limits its placement may be the only plan that fits) for the device cover's MILP
    on several devices (``exact.cover.device_cover``): its bound, and a placement that
    greedy eviction plans on (for at most ``evict_time_s``)."""
    closure_cells: int = 3000
    closure_depth: int = 8
    """The closure cover's LP (``exact.cover.closure_extra_ms``, beside the cover): its
    binding stages that need most are kept while their dropped-value columns number at
    most ``closure_cells``, and rows follow a value's inputs ``closure_depth`` steps back."""

    # --- Moccasin (``remat.strategies.exact.moccasin``) -----------------------------------
    moccasin_computations: int = 2
    """Most computations of one node in Moccasin's model (the paper's C_v): the first and
    this many minus one recomputations."""
    moccasin_hint_share: float = 0.25
    """From a warm start, on two threads or more, CP-SAT searches Moccasin's model by LNS
    alone (``intervals.solve_intervals``); where its first-solution workers have completed
    no solution from the hint after this share of the time left, the default portfolio
    (with a full-problem worker) takes the rest; 0: the default portfolio from the start."""

    # --- window neighbourhoods (``remat.strategies.exact.windows``) -----------------------
    window_stages: int = 100
    """Stages in the first window neighbourhood, on average: a single window takes from
    half to one and a half times as many, a mirrored pair half as many in its forward
    range; the size then adapts to the solves' times."""
    window_solve_s: float = 5.0
    """The most one window neighbourhood's CP-SAT solve may take."""
    window_stall_s: float = 1.0
    """A window neighbourhood's solve stops once it has found no better solution for this
    long: a neighbourhood's improvements come early, and proving the last one optimal
    can take the rest of ``window_solve_s``."""
    window_seed: int = 0
    """The seed of the windows' random choice (the same windows for the same incumbents)."""
    windows_share: float = 0.6
    """Of the time left for the whole graph's interval model where the incumbent is on its
    placement: the window neighbourhoods take this share first."""
    windows_min_nodes: int = 600
    """Graphs with fewer nodes go straight to CP-SAT's search on the whole interval model,
    which improves them faster than window neighbourhoods do."""
    neighbourhood_stall_share: float = 0.1
    """Of the time limit: CP-SAT's search on the whole interval model and the window
    neighbourhoods take turns, each until the incumbent has not improved for this long."""

    # --- coarsening (``remat.strategies.exact.coarsen``) ----------------------------------
    coarse_min_nodes: int = 40
    """Graphs with fewer nodes are not coarsened: they solve well as they are."""
    coarse_max_ratio: float = 0.8
    """The coarse graph is solved only when it has at most this share of the nodes."""
    coarse_max_group: int = 4
    """Most nodes fused into one coarse node: a longer run restricts the coarse problem
    more than it shrinks it."""

    # --- decomposition (``remat.strategies.exact.decompose``) -----------------------------
    decompose_min_nodes: int = 250
    """Graphs with more nodes are decomposed: the whole MILP is not built. On one device
    the stitched plan then warm-starts Moccasin's interval model of the whole graph
    (``intervals.solve_intervals``)."""
    segment_forward_nodes: int = 50
    """Forward nodes per segment of a decomposed graph (parts of about twice as many)."""
    min_part_s: float = 1.0
    """A part whose share of the time left is below this gets a quick plan, no solve: its
    best baseline, or where none fits greedy eviction (``part_evict_s``)."""
    part_evict_s: float = 0.02
    part_fit_s: float = 1.0
    """Greedy eviction on a part that no baseline fits: ``part_evict_s`` of descent past its
    first plan that fits, which may take up to ``part_fit_s``."""
    parts_share: float = 0.3
    """Of the time left on one device: the most the parts may take; the whole graph's
    interval model has the rest."""
    judge_share: float = 0.4
    """Of the parts' time: the most that judging which forward values the segments keep
    may take once one choice has a plan (``decompose._chosen``); the parts' solves have the
    rest."""
    alone_share: float = 0.5
    """Of the time left on several devices: the least the one-device search takes before
    it stops for the whole graph's interval model on the device cover's placement (where
    one is worth it; otherwise it takes all the time)."""
    placement_trial_share: float = 0.25
    """Of the time left when that search stops for the device cover's placement: how long
    the interval model on the placement runs without a plan below the incumbent (from
    ``windows_min_nodes`` on, without any plan on it; window neighbourhoods improve its
    first plans there) before it stops and the interval model on the one device resumes
    for the time left."""
    device_closure_cells: int = 800
    """The device cover with closure rows keeps binding stages as the closure cover's LP
    does (``closure_cells``), to this many dropped-value columns per device: on the bench's
    networks fewer stages left its LP optimum as it was and let its MILP prove a higher
    bound in less time (docs/benchmarks.md)."""
    closure_presolve: bool = False
    """Whether the solver presolves the device cover with closure rows: HiGHS's MIP
    presolve leaves it a root LP that takes longer to solve, so its bound and its first
    placements come later (docs/benchmarks.md)."""
    stall_share: float = 0.15
    stall_rise: float = 1e-3
    stall_room: float = 0.01
    """On several devices, the device cover with closure rows beside the one-device search
    stops once its bound has risen by less than ``stall_rise`` (relative) over the last
    ``stall_share`` of the time limit, where its placement is on one device, or on several
    at a relaxed cost no lower than the one-device search's bound while its bound is
    within ``stall_room`` (relative) of that bound (``search._Stalled``)."""

    # --- restrictions, LP relaxation and RINS (``restrict``, ``rins``) --------------------
    restricted_share: float = 0.25
    """At most this share of the time limit for each restriction beside the full solve
    (placement only, greedy eviction on a placement or on bands)."""
    band_evictions: int = 20
    """Greedy eviction on bands runs only if eviction on the warm start's placement took at
    most 1/``band_evictions`` of ``restricted_share``."""
    placement_min_s: float = 180.0
    """Seconds that must be left to solve the model restricted to the LP relaxation's
    placement; with less, node moves from the incumbent run instead."""
    lp_backend: str = "highs"
    """The backend of the LP relaxations and of the bound-only solves (the device cover
    with closure rows), whatever the backend of the MILPs."""
    rins_one_device_backend: str = "cpsat"
    """The backend of RINS's sub-MIPs on one device, whatever the problem's backend."""
    rins_agree: float = 1e-6
    """RINS fixes an integer variable where the LP value is this close to the
    incumbent's."""

    # --- offloading (``remat.strategies.heuristics.offload_dynprog``) ----------------------
    offload_slots: int = 500
    """DYNPROG's memory discretization: the candidates' total bytes in this many slots
    (Beaumont et al., section 5.3.2: 500)."""
    offload_states: int = 2000
    """The most states DYNPROG keeps per candidate (the least idle time)."""
    offload_epsilons: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1)
    """Budget reductions DYNPROG tries in turn until its set's plan fits."""
    offload_remat_ladder: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    """``offload_remat``: the relaxed budgets greedy eviction recomputes to before offloading
    brings the plan down to the budget, as fractions of the way from the budget up to
    checkpoint-all's peak; the best one's neighbours at half the spacing follow."""
    offload_remat_share: float = 0.5
    """``offload_remat``: the share of the time left after GREEDY for ``checkmate_milp``'s
    search (and, beside it, the offloading heuristics) before the joint MILP starts from its
    plan (all of it where the joint model is not built)."""
    port_secondary_share: float = 0.15
    """``port``: the share of the time limit kept for the second (beta) solve of PORT's
    lexicographic objectives."""
    port_remat_share: float = 0.75
    """``port``: the share of its search's time for ``checkmate_milp`` (and beside it the
    paging heuristics) before the joint MILP (``offload_remat_share`` for offloading)."""
    port_m_xengine_share: float = 0.5
    """``port_m``: the share of the time limit for XEngine's search (whose plans are
    compiled concurrent where they fit) before PORT-M's MILP starts from its plan (all but
    ``port_m_ahead_share`` where the MILP is not built)."""
    port_m_ahead_share: float = 0.05
    """``port_m``: the share of the time limit kept, after XEngine's search, for moving its
    recomputation a stage ahead onto another device (``recompute_ahead``)."""
    port_m_milp_max_nodes: int = 60
    """``port_m``: PORT-M's MILP (about twice XEngine's model, with paging) is built only
    on graphs of at most this many nodes; on larger ones its time goes to XEngine's search
    (docs/strategies.md, PORT-M)."""
    port_m_alone_share: float = 0.25
    """``port_m``: the share of the time limit for ``port`` on the pool as one device
    (``common.pooled``; rematerializing and paging, POET's setting on the pool), after
    XEngine's search and before PORT-M's MILP (0: none); where the MILP is not built, for
    ``port``'s paging heuristics on it in a process beside XEngine's search."""
    port_time_tolerance: float = 0.01
    """``port``: how far above the best time (relative) a plan may be and still be chosen
    for fewer computations and page transfers (PORT's beta objectives)."""

    # --- LP rounding (``remat.strategies.exact.checkmate``) -------------------------------
    lp_epsilons: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3)
    """The budget reductions swept by Checkmate's LP rounding (section 5.3, appendix D)."""
    min_lp_s: float = 1.0
    """The LP at epsilon 0 (the bound) gets at least this long."""


DEFAULT_SEARCH = SearchConfig()
