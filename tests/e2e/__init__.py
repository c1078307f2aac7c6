"""End-to-end tests: real pods on the local nodes, from kubectl apply to tokens."""
