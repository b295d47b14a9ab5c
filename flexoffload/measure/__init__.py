"""What is measured on this machine: disk and compute, operators, sensitivity, tuning."""
