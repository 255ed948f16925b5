"""Where Tandem's processes run outside Kubernetes' own pods: the launcher, the local stack (`tandem serve`), Ray
Serve, and the drain a worker pod's preStop hook runs."""
