"""`pdserve simulate` and `pdserve plan`: a discrete-event simulation of a pdserve deployment that
drives pdserve's own router index and ranking, placement cost model and autoscaling policy, with
replicas whose step times come from a roofline per accelerator (roofline.py, hardware.py). Pure
Python: no Ray, no engine (calibration.py alone runs the real engine, to fit the `cpu` profile)."""
