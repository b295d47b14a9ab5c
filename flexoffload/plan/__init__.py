"""Planning over data (a Model, a Profile, a budget): the cost model, planners, placers, plan files."""
