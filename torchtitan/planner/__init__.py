"""Planning a cluster before renting it: GPU specs, the performance model, and the search over layouts."""
