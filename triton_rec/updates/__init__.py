"""Online embedding updates: the HPS message format over Redis Streams or Kafka.

- :mod:`.codec`: the message format (HPS ``KafkaMessageSink``) and topic names;
- :mod:`.transport`: the streams: connection, consumer groups, stream state;
- :mod:`.producer`: :class:`UpdateProducer` publishes to Redis Streams (the trainer side);
- :mod:`.consumer`: :class:`ConsumerCore` (decode, merge, apply, count: every transport's)
  and :class:`UpdateConsumer`, which reads a group's Redis Streams and applies them;
- :mod:`.kafka`: :class:`KafkaUpdateProducer` and :class:`KafkaUpdateConsumer`, HPS's
  Kafka sink and source (``confluent-kafka``, imported when first used);
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
from triton_rec.updates.consumer import ConsumerCore, UpdateConsumer
from triton_rec.updates.kafka import KafkaUpdateConsumer, KafkaUpdateProducer, kafka_info
from triton_rec.updates.producer import UpdateProducer
from triton_rec.updates.transport import stream_info

__all__ = [
    "MAGIC",
    "ConsumerCore",
    "KafkaUpdateConsumer",
    "KafkaUpdateProducer",
    "UpdateConsumer",
    "UpdateMessageError",
    "UpdateProducer",
    "decode_message",
    "encode_message",
    "kafka_info",
    "parse_topic",
    "stream_info",
    "topic_name",
]
