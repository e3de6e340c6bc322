"""The telephony door: phone calls from carriers' media streams (Twilio Media Streams, Telnyx media streaming) as
sessions of the gateway, one adapter per carrier over the same session and turn controller as every other door."""
