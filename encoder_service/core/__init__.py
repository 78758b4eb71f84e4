"""The service core, under both transports (api/): one module per step of an encode and a fetch.

  encoder.py     EncoderCore: encode / fetch / release / metadata / readiness; the only place that knows the flow
  image_encode.py, encode_steps.py
                 an encode of images; the steps it shares with video_encode.py
  id_rows.py     where a fetched id's rows come from: its flight, the local tier, another replica
  types.py       what it takes and answers (ImageInput, VideoInput, EncodeResult, FetchItem, FetchResult)
  images.py      an image from request bytes to engine input: read (urls.py), probe (key + size), prepare
  videos.py      a video to engine input, frame group by frame group: read, probe (limits, plan, key), one
                 decoder per video, prepare; video_flights.py: a video's groups fed to the engine in order, a
                 window at a time; video_encode.py: an encode of videos (admission, pins, the answer)
  flight.py      the one single flight: a Flight per id (waiters, queue permit, a fill that calls the replicas'
                 face, replicas/face.py, and the engine)
  take_over.py   an image whose accepting replica is gone, encoded here from the bytes it kept (the face calls it)
  fetch_destination.py
                 where a fetch's rows go (the answer, a shm file, IPC), chosen before any wait
  ipc_fetch.py   a fetch answered with where the rows sit on the GPU (CUDA IPC) instead of the rows
  shm_writer.py  shared-memory fetch, server side: rows into a co-located client's file
  urls.py        allow-listed URL images
  metrics.py     Prometheus metrics (one registry per core); cache_metrics.py: the cache's and shm's counters on it
"""

from encoder_service.core.encoder import EncoderCore
from encoder_service.core.types import EncodeResult, FetchItem, FetchResult, ImageInfo, ImageInput

__all__ = ["EncodeResult", "EncoderCore", "FetchItem", "FetchResult", "ImageInfo", "ImageInput"]
