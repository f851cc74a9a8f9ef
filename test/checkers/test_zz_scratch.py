import unittest, time
from offload_scenarios import (OneRequestAtATime, colocated_lifecycle, pd_decode_lifecycle,
    mtp_verify_steps, setUpModule, tearDownModule)

class T1(OneRequestAtATime):
    def test_one(self):
        t = time.time(); print(self._run(2), time.time() - t)
class T2(unittest.TestCase):
    def test_colo(self):
        t = time.time(); colocated_lifecycle(self); print("colo", time.time() - t)
    def test_pd(self):
        t = time.time(); pd_decode_lifecycle(self); print("pd", time.time() - t)
    def test_mtp(self):
        t = time.time(); mtp_verify_steps(self); print("mtp", time.time() - t)
