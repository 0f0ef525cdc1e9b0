"""Planner: enumerate mesh candidates, solve the CP-SAT co-design model, explain infeasibility, export to TorchRec."""
