"""`kvtier deploy`: a kvtier fleet on Kubernetes, from the same deployment file as `kvtier up`."""
