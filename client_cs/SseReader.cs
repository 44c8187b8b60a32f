using System;
using System.IO;
using System.Text;
using System.Threading.Tasks;

namespace ChatCli
{
    /// <summary>One dispatched Server-Sent Event.</summary>
    public sealed class SseEvent
    {
        /// <summary>The event type: the last "event:" field, or "message" when there was none.</summary>
        public string Type;
        /// <summary>The "data:" lines of the event joined with "\n".</summary>
        public string Data;
        /// <summary>The last event ID seen so far on the stream (may be empty).</summary>
        public string LastEventId;
        /// <summary>This event's own "id:" value, or null when it had no "id:" line.</summary>
        public string Id;

        public override string ToString()
        {
            return Type + ": " + Data;
        }
    }

    /// <summary>
    /// Reads Server-Sent Events (the text/event-stream format of the HTML standard)
    /// from a TextReader, one event per <see cref="ReadEventAsync"/> call.
    ///
    /// Self-contained: copy this file into another project and wrap the response
    /// stream in a StreamReader with UTF-8 (which also copes with a character split
    /// across network reads and drops a leading BOM, as the standard asks).
    /// Lines may end in LF, CRLF or a lone CR (TextReader.ReadLine accepts all three).
    /// </summary>
    public sealed class SseReader
    {
        readonly TextReader reader;
        readonly StringBuilder data = new StringBuilder();
        string eventType = "";
        string lastEventId = "";
        string eventId; // this event's own "id:" value

        public SseReader(TextReader reader)
        {
            if (reader == null) throw new ArgumentNullException("reader");
            this.reader = reader;
        }

        /// <summary>The reconnection time the server asked for with "retry:", or null.</summary>
        public int? RetryMilliseconds { get; private set; }

        /// <summary>
        /// Returns the next event, or null at the end of the stream. An event that was
        /// not finished by a blank line before the end of the stream is discarded,
        /// as the standard says. Comment lines (starting with ':') are skipped.
        /// </summary>
        public async Task<SseEvent> ReadEventAsync()
        {
            while (true)
            {
                string line = await reader.ReadLineAsync().ConfigureAwait(false);
                if (line == null) return null;

                if (line.Length == 0)
                {
                    SseEvent ev = Dispatch();
                    if (ev != null) return ev;
                    continue;
                }
                ProcessLine(line);
            }
        }

        void ProcessLine(string line)
        {
            if (line[0] == ':') return; // comment, e.g. a keep-alive

            string field;
            string value;
            int colon = line.IndexOf(':');
            if (colon < 0)
            {
                field = line;
                value = "";
            }
            else
            {
                field = line.Substring(0, colon);
                int start = colon + 1;
                if (start < line.Length && line[start] == ' ') start++; // one optional space
                value = line.Substring(start);
            }

            switch (field)
            {
                case "event":
                    eventType = value;
                    break;
                case "data":
                    data.Append(value).Append('\n');
                    break;
                case "id":
                    if (value.IndexOf('\0') < 0) lastEventId = eventId = value;
                    break;
                case "retry":
                    int ms;
                    if (value.Length > 0 && IsAsciiDigits(value) && int.TryParse(value, out ms))
                        RetryMilliseconds = ms;
                    break;
                default:
                    break; // unknown fields are ignored
            }
        }

        SseEvent Dispatch()
        {
            if (data.Length == 0)
            {
                // Nothing to dispatch: a blank line after only "event:"/"id:" lines or comments.
                eventType = "";
                eventId = null;
                return null;
            }
            data.Length -= 1; // the "\n" appended after the last data line
            var ev = new SseEvent
            {
                Type = eventType.Length == 0 ? "message" : eventType,
                Data = data.ToString(),
                LastEventId = lastEventId,
                Id = eventId,
            };
            data.Clear();
            eventType = "";
            eventId = null;
            return ev;
        }

        static bool IsAsciiDigits(string s)
        {
            foreach (char c in s)
                if (c < '0' || c > '9') return false;
            return true;
        }
    }
}
