"""The tree of token-tree speculation, without llama.cpp (spectree.py)."""

import pytest

from flexoffload.speculation import tree as spectree
from flexoffload.speculation.tree import Branch, Node, Tree


def _branch(conf: float, length: int, done: bool = False) -> Branch:
    leaf = Node(1, None, 10 + length, conf, conf)
    return Branch(0, leaf, length, done)


def test_pacer_gives_the_next_token_to_the_branch_furthest_below_its_share():
    # f(x) = M * C_x / sum(C) - T_x with C = 0.6 and 0.2: shares of M are 3/4 and 1/4
    assert spectree.pace([_branch(0.6, 2), doubtful := _branch(0.2, 1)], 4) is not doubtful  # 1 against 0
    assert spectree.pace([_branch(0.6, 4), doubtful := _branch(0.2, 0)], 4) is doubtful  # -1 against 1
    assert spectree.pace([confident := _branch(0.6, 3), _branch(0.2, 1)], 8) is confident  # 3 against 1
    assert spectree.pace([_branch(0.6, 7), doubtful := _branch(0.2, 0)], 8) is doubtful  # -1 against 2
    assert spectree.pace([_branch(0.9, 0, done=True)], 4) is None


def test_round_robin_grows_the_shortest():
    a, b = _branch(0.9, 3), _branch(0.1, 2)
    assert spectree.round_robin([a, b]) is b
    assert spectree.round_robin([_branch(0.9, 0, done=True)]) is None


def test_alpha_halves_when_all_correct_and_is_the_error_fraction_otherwise():
    assert spectree.next_alpha(0.01, 5, 5) == pytest.approx(0.005)
    assert spectree.next_alpha(0.01, 3, 4) == pytest.approx(0.25)
    assert spectree.next_alpha(0.5, 0, 2) == pytest.approx(1.0)


def test_path_from_walks_down_from_the_top():
    root = Node(1, None, 5, 1.0, 1.0)
    a = Node(2, root, 6, 0.5, 0.5)
    b = Node(3, a, 7, 0.5, 0.25)
    assert [n.token for n in b.path_from(root)] == [1, 2, 3]
    assert b.path_from(b) == [b]


def _chain(tree: Tree, leaf: Node, tokens: list[int], prob: float = 0.5) -> Node:
    for token in tokens:
        leaf = tree.add(leaf, token, prob)
    return leaf


def _forked() -> tuple[Tree, Node]:
    """1 -> 2, then 3 -> 4 (branch 0) and 5 (branch 1) below 2; the tree and the fork (2)."""
    tree = Tree(Node(1, None, 10, 1.0, 1.0))
    fork = _chain(tree, tree.root, [2])
    tree.branches[0].leaf = _chain(tree, fork, [3, 4])
    tree.branches.append(Branch(1, _chain(tree, fork, [5])))
    return tree, fork


def test_a_pass_takes_each_branch_from_the_root_down_and_its_nodes_know_their_branches():
    tree, fork = _forked()
    assert tree.n_nodes == 5
    nodes, seqs = tree.for_pass(10)
    assert [n.token for n in nodes] == [1, 2, 3, 4, 5]  # branch 0 whole, then what branch 1 adds
    assert [n.pos for n in nodes] == [10, 11, 12, 13, 12]
    assert [seqs[id(n)] for n in nodes] == [[0, 1], [0, 1], [0], [0], [1]]
    assert all(n.in_pass for n in nodes)
    short, _ = Tree(Node(7, None, 0, 1.0, 1.0)).for_pass(10)
    assert len(tree.for_pass(3)[0]) == 3 and len(short) == 1


def test_the_walk_follows_the_targets_tokens_while_they_are_verified_children():
    tree, fork = _forked()
    nodes, _ = tree.for_pass(10)
    # the target's token at each row: after 1 it says 2, after 2 it says 5 (the second branch), after 5 it says 9
    says = {0: 2, 1: 5, 4: 9}
    out, last, ended = tree.walk(nodes, says.__getitem__, lambda token: False)
    assert out == [2, 5, 9] and last.token == 5 and not ended
    assert tree.matched(last) == 2  # branch 1 below the root: 2 and 5
    out, last, ended = tree.walk(nodes, {0: 2, 1: 3, 2: 0}.__getitem__, lambda token: token == 0)
    assert out == [2, 3, 0] and last.token == 3 and ended  # end of text stops the walk, accepted so far kept
    assert tree.owner(last) == 0 and tree.owner(fork) == 0


def test_the_branch_threshold_follows_which_branches_the_target_takes():
    tree, _ = _forked()
    nodes, _ = tree.for_pass(10)
    side = tree.walk(nodes, {0: 2, 1: 5, 4: 9}.__getitem__, lambda token: False)[1]
    top = tree.walk(nodes, {0: 2, 1: 3, 2: 4, 3: 8}.__getitem__, lambda token: False)[1]
    assert tree.had_branch(nodes) and tree.took_branch(side) and not tree.took_branch(top)
    assert not tree.had_branch(nodes[:4])  # the top chain alone
    t = spectree.THRESHOLD
    assert spectree.next_threshold(t, True, True, False) == pytest.approx(t * 0.8)  # a branch paid: more of them
    assert spectree.next_threshold(t, False, True, True) == pytest.approx(t * 1.25)  # branches unused: fewer
    assert spectree.next_threshold(t, False, False, False) == pytest.approx(t * 0.8)  # a chain broke, none to fall on
    assert spectree.next_threshold(t, False, False, True) == t
    lo, hi = spectree.THRESHOLD_RANGE
    assert spectree.next_threshold(hi, False, True, True) == hi and spectree.next_threshold(lo, True, True, True) == lo


def test_a_tree_from_a_chain_drafted_during_the_pass_counts_confidence_from_its_new_root():
    old = Tree(Node(1, None, 10, 1.0, 1.0))
    reuse = _chain(old, old.root, [2], prob=0.4)
    leaf = _chain(old, reuse, [3, 4], prob=0.5)
    tree = Tree(reuse, leaf)
    assert tree.root is reuse and reuse.parent is None and reuse.conf == 1.0
    assert tree.n_nodes == 3 and tree.branches[0].leaf is leaf and tree.branches[0].seq == 0
    assert leaf.conf == pytest.approx(0.25) and tree.confidence() == pytest.approx(0.25)


def test_nodes_whose_compute_fits_in_a_streamed_pass_s_wait_cost_nothing():
    node_s, hidden = spectree.node_costs(0.30, 0.05)  # a 0.3 s pass, 0.05 s of it compute
    assert node_s == pytest.approx(spectree.VERIFY_SHARE * 0.05)
    assert hidden == int(0.25 / node_s)  # 7: what fits in the 0.25 s spent waiting for reads
    assert spectree.node_costs(0.05, 0.05)[1] == 0  # compute-bound: no wait to hide in
    assert spectree.node_costs(0, 0.05) == (node_s, 0)  # no plan: unknown
