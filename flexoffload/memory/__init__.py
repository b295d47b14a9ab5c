"""Memory: budgets and cgroups, what a run takes beside its weights, per-step memory."""
