"""The learner's update: its time, FLOPs, matmul peak and scan op counts,
beside upstream DreamerV3's."""
