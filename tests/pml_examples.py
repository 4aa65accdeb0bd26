"""PML sources shared by the PML tests: the travel example of the design, with a scaffold added."""

TRAVEL_XML = """<schema name="travel">
  <system>You are a helpful travel agent.</system>
  <module name="plan">Plan a trip of <param name="duration" len="4"/> for the user.</module>
  <union>
    <module name="tokyo">Tokyo is the capital of Japan ...</module>
    <module name="paris">Paris is the capital of France ...</module>
  </union>
  <scaffold name="pair"><module name="a">A text</module><module name="b">B text</module></scaffold>
</schema>"""

PROMPT_XML = (
    '<prompt schema="travel"><plan duration="3 days"/><tokyo/><user>Highlight the food markets.</user></prompt>'
)
