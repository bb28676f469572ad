"""Online embedding updates: the HPS message format over Redis Streams.

- :mod:`.codec`: the message format (HPS ``KafkaMessageSink``) and topic names;
- :mod:`.transport`: the streams: connection, consumer groups, stream state;
- :mod:`.producer`: :class:`UpdateProducer` publishes (the trainer side);
- :mod:`.consumer`: :class:`UpdateConsumer` reads a group's topics and applies them;
- :mod:`.online`: a model instance's consumer (tiers, then the shared cache);
- :mod:`.cli`: ``python -m triton_rec.updates publish|info ...`` (``--help``).

The public names are importable from here (``from triton_rec.updates import
UpdateProducer``).
"""

from triton_rec.updates.codec import (
    MAGIC,
    UpdateMessageError,
    decode_message,
    encode_message,
    parse_topic,
    topic_name,
)
from triton_rec.updates.consumer import UpdateConsumer
from triton_rec.updates.producer import UpdateProducer
from triton_rec.updates.transport import stream_info

__all__ = [
    "MAGIC",
    "UpdateConsumer",
    "UpdateMessageError",
    "UpdateProducer",
    "decode_message",
    "encode_message",
    "parse_topic",
    "stream_info",
    "topic_name",
]
