"""The sharding planner (``recserve plan``): the plan's nouns (``plan``), the measured costs it weighs
(``costs``), the planner that chooses for training (``planner``) and the serving plan
(``serving_plan``)."""
