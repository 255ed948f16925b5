"""Capacity planning: pure sizing math (`sizing`), curve analysis (`curves`), service-time models
(`service_model`), the planner policy the operator reuses (`policy.recommend`), and a discrete-event fleet
simulator (`simulator`) to judge policies on diurnal traces. `command` and `report` serve `tandem plan`.
"""
