"""Choosing by measurement: candidates trained side by side (bench), the precision to train in
(recommend), ``auto`` confirmed on the model (autoselect), and how sure a speed-up is (speed)."""
